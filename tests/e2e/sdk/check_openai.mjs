// The official OpenAI SDK (npm `openai`) against a pdserve base URL, as a
// user would point it: node check_openai.mjs http://127.0.0.1:PORT/v1
// Prints one line per check; exits 1 on the first failure.
import OpenAI from "openai";

const client = new OpenAI({ baseURL: process.argv[2], apiKey: "unused", maxRetries: 0 });
const model = "pdserve-tiny";
const messages = [
  { role: "system", content: "Be brief." },
  { role: "user", content: "Hello there" },
];

function check(cond, what, detail) {
  if (!cond) {
    console.log(`FAIL ${what}: ${JSON.stringify(detail)}`);
    process.exit(1);
  }
  console.log(`ok ${what}`);
}

const models = await client.models.list();
const ids = [];
for await (const m of models) ids.push(m.id);
check(ids.includes(model), "models.list names the served model", ids);
const one = await client.models.retrieve(model);
check(one.id === model, "models.retrieve", one);

const chat = await client.chat.completions.create({ model, messages, max_completion_tokens: 6 });
const content = chat.choices[0].message.content;
check(chat.object === "chat.completion" && chat.choices[0].finish_reason === "length" &&
      chat.usage.completion_tokens === 6, "chat.completions.create", chat);

const chatStream = await client.chat.completions.create({
  model, messages, max_completion_tokens: 6, stream: true, stream_options: { include_usage: true },
});
let streamed = "", usage = null;
for await (const chunk of chatStream) {
  streamed += chunk.choices[0]?.delta?.content ?? "";
  if (chunk.usage) usage = chunk.usage;
}
check(streamed === content, "streamed chat equals the plain answer", { streamed, content });
check(usage && usage.completion_tokens === 6, "stream_options.include_usage", usage);

const cmpl = await client.completions.create({ model, prompt: "Once upon", max_tokens: 5 });
check(cmpl.choices[0].finish_reason === "length" && cmpl.usage.completion_tokens === 5,
      "completions.create", cmpl);
const cmplStream = await client.completions.create({
  model, prompt: "Once upon", max_tokens: 5, stream: true,
});
let ctext = "";
for await (const chunk of cmplStream) ctext += chunk.choices[0]?.text ?? "";
check(ctext === cmpl.choices[0].text, "streamed completion equals the plain one",
      { ctext, plain: cmpl.choices[0].text });

// An abort mid-stream: the client goes away; the server must abort the request
// (the test around this checks every node ends idle and clean).
const long = await client.chat.completions.create({
  model, messages, max_completion_tokens: 2000, stream: true, ignore_eos: true,
});
let seen = 0, finished = false, error = null;
try {
  for await (const chunk of long) {
    if (chunk.choices[0]?.finish_reason) finished = true;
    if (++seen === 3) long.controller.abort();
  }
} catch (e) {
  error = e.name;
}
// The SDK either ends the iteration or throws its abort error.
check(!finished && seen >= 3 && seen < 50 && (error === null || /Abort/.test(error)),
      "abort mid-stream", { seen, finished, error });

// n = 2 with a seed: two choices, numbered, drawn from their own streams
// (they differ), and the same again when streamed.
const two = await client.chat.completions.create({
  model, messages, max_completion_tokens: 8, n: 2, temperature: 1.0, seed: 7,
});
const texts = two.choices.map((c) => c.message.content);
check(two.choices.length === 2 && two.choices[0].index === 0 && two.choices[1].index === 1 &&
      texts[0] !== texts[1] && two.usage.completion_tokens === 16, "n=2", two);
const twoStream = await client.chat.completions.create({
  model, messages, max_completion_tokens: 8, n: 2, temperature: 1.0, seed: 7, stream: true,
});
const parts = ["", ""];
for await (const chunk of twoStream)
  for (const c of chunk.choices) parts[c.index] += c.delta?.content ?? "";
check(parts[0] === texts[0] && parts[1] === texts[1], "n=2 streamed equals plain", { parts, texts });

// stop: a piece of the greedy answer; the answer ends just before its first
// occurrence, with finish_reason "stop", plain and streamed.
const full = await client.completions.create({ model, prompt: "Once upon", max_tokens: 24 });
const whole = full.choices[0].text;
const cps = Array.from(whole);
const stop = cps.slice(6, 8).join("");
const cut = whole.slice(0, whole.indexOf(stop));
const stopped = await client.completions.create({ model, prompt: "Once upon", max_tokens: 24, stop: [stop] });
check(stopped.choices[0].text === cut && stopped.choices[0].finish_reason === "stop" &&
      stopped.usage.completion_tokens < 24, "stop", { stop, cut, got: stopped.choices[0] });
const stopStream = await client.completions.create({
  model, prompt: "Once upon", max_tokens: 24, stop: stop, stream: true,
});
let stext = "", sfin = null;
for await (const chunk of stopStream) {
  stext += chunk.choices[0]?.text ?? "";
  sfin = chunk.choices[0]?.finish_reason ?? sfin;
}
check(stext === cut && sfin === "stop", "stop, streamed: never shows the stop string", { stext, cut, sfin });

// logprobs: one entry per token; greedy picks the likeliest, so the chosen
// token is the first alternative, with the same logprob.
const lp = await client.chat.completions.create({
  model, messages, max_completion_tokens: 5, logprobs: true, top_logprobs: 3,
});
const content5 = lp.choices[0].logprobs?.content ?? [];
check(content5.length === 5 && content5.every((t) => t.top_logprobs.length === 3 &&
      t.logprob <= 0 && t.top_logprobs[0].logprob === t.logprob &&
      t.top_logprobs[0].logprob >= t.top_logprobs[2].logprob &&
      t.token === t.top_logprobs[0].token), "chat logprobs", lp.choices[0].logprobs);
const clp = await client.completions.create({ model, prompt: "Once upon", max_tokens: 4, logprobs: 2 });
const L = clp.choices[0].logprobs;
check(L && L.tokens.length === 4 && L.token_logprobs.length === 4 && L.top_logprobs.length === 4 &&
      L.text_offset[0] === 0 && L.tokens.join("") === clp.choices[0].text,
      "completions logprobs", L);

for (const [extra, name] of [[{ logit_bias: { 5: 1 } }, "'logit_bias'"],
                             [{ tools: [{ type: "function", function: { name: "f" } }] }, "'tools'"],
                             [{ response_format: { type: "json_object" } }, "'response_format'"]]) {
  let status = 0, message = "";
  try {
    await client.chat.completions.create({ model, messages, max_completion_tokens: 2, ...extra });
  } catch (e) {
    status = e.status;
    message = e.message;
  }
  check(status === 400 && message.includes(name), `unsupported ${name} is a 400 naming it`,
        { status, message });
}
console.log("all checks passed");
