// Renders one template with one context through @huggingface/jinja (the
// reference): reads {"template": "...", "context": {...}} on stdin, writes
// the rendered bytes to stdout. Used by tests/e2e/test_hf_checkpoint.py.
import { readFileSync } from "node:fs";
import { Template } from "@huggingface/jinja";

const { template, context } = JSON.parse(readFileSync(0, "utf8"));
process.stdout.write(new Template(template).render(context));
