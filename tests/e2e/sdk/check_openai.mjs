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

for (const [extra, name] of [[{ n: 2 }, "'n'"], [{ logprobs: true }, "'logprobs'"],
                             [{ stop: ["\n"] }, "'stop'"]]) {
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
