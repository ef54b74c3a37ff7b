"""End-to-end: the command line takes SGLang's and sgl-router's habits, and
says the truth (issue 11, "Flags").

- `--help` of every command lists exactly the options its parser takes: each
  listed option is accepted, each option some command lists but this one
  does not is refused (the commands come from `pdserve --help`, the options
  from the help texts themselves, so a new one is covered without edits);
- serve --disaggregation-mode prefill|decode runs as pdserve prefill|decode
  would, end to end behind a router;
- --api-key: 401 without the key or with a wrong one, 200 with it, probes and
  scrapes exempt, on a node and through the router of `pdserve run`;
- --context-length: a request over it is a 400 naming it;
- --log-level filters what the commands print;
- the router takes sgl-router's --pd-disaggregation --prefill URL PORT form;
- an unknown or inapplicable option is refused with a message that names
  the command and says what to use instead.
"""
import concurrent.futures
import http.client
import json
import re
import subprocess
import time

import pdtest
from pdtest import Server

UCX_ENV = {"UCX_TLS": "tcp", "UCX_NET_DEVICES": "lo", "UCX_WARN_UNUSED_ENV_VARS": "n"}


def pdserve(args, timeout=60):
    return subprocess.run([pdtest.PDSERVE] + list(args), capture_output=True, text=True,
                          timeout=timeout)


# ---- --help is true --------------------------------------------------------------------

HELP_LINE = re.compile(r"^\s+(--[a-z0-9][a-z0-9-]*)(?: (\S+))?(?:\s{2,}|\s*$)")


def help_options(text):
    """{option: its argument or None} of every help line that starts with one."""
    out = {}
    for line in text.splitlines():
        m = HELP_LINE.match(line)
        if m and m.group(1) not in ("--help", "--version"):
            out.setdefault(m.group(1), m.group(2))
    return out


def sample_value(arg):
    """A value of the shape the help shows (validity does not matter: a
    refused value proves the option's name is known)."""
    if "|" in arg:
        return arg.split("|")[0]
    if arg == "A..B":
        return "1..2"
    if re.fullmatch(r"[A-Z]", arg):
        return "1"
    return "x"


def word(flag):
    return re.compile(r"(?<![\w-])%s(?![\w-])" % re.escape(flag))


def verdict(ctx, flag, arg):
    """What `pdserve CTX FLAG [VALUE] --zzz-a --zzz-b` says about FLAG. Two
    unknown options end it: if the parser took FLAG it stops at --zzz-a; if
    it took one more argument than the help shows, at --zzz-b."""
    args = list(ctx) + [flag] + ([sample_value(arg)] if arg else []) + ["--zzz-a", "--zzz-b"]
    r = pdserve(args)
    err = r.stdout + r.stderr
    if r.returncode == 0 or "--zzz-b" in err:
        return "took more than its help says: " + err[-300:]
    if "--zzz-a" in err:
        return "accepted"
    if word(flag).search(err) and re.search(r"unknown option|does not apply|only for", err):
        return "refused"
    if word(flag).search(err):
        return "accepted"  # its value was refused: the name is known
    return "unclear: " + err[-300:]


def commands():
    r = pdserve(["--help"])
    assert r.returncode == 0, r.stderr
    names = re.findall(r"^  ([a-z]+) {2,}", r.stdout, re.M)
    assert {"serve", "prefill", "decode", "run", "router", "generate", "sim", "model"} <= set(names)
    return names


def contexts():
    """Each way to run a command, with the argv prefix that selects it and
    the help that describes it. `model` has two subcommands and one help: an
    option is accepted by it when either takes it."""
    ctx = {}
    for name in commands():
        subs = [[name, "init"], [name, "info"]] if name == "model" else [[name]]
        ctx[name] = (subs, [name])
        if name == "serve":
            for mode in ("prefill", "decode", "null"):
                pre = [name, "--disaggregation-mode", mode]
                ctx["serve --disaggregation-mode " + mode] = ([pre], pre)
    return ctx


def test_help_lists_exactly_the_options_each_command_takes():
    """Issue 11: `run --help` said the transfer default was ucx while run
    refused ucx, and serve took prefill-only options in silence."""
    ctx = contexts()
    helps = {}
    for key, (_, help_argv) in ctx.items():
        r = pdserve(help_argv + ["--help"])
        assert r.returncode == 0 and r.stdout, (key, r.returncode, r.stderr)
        helps[key] = help_options(r.stdout)
        assert helps[key], (key, r.stdout)
    universe = {}
    for opts in helps.values():
        for flag, arg in opts.items():
            universe.setdefault(flag, arg)
    for flag in ("--tp-size", "--mem-fraction-static", "--worker-urls"):  # SGLang's, never ours
        universe.setdefault(flag, "N")
    jobs = {}
    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        for key, (argvs, _) in ctx.items():
            for flag in universe:
                arg = helps[key].get(flag, universe[flag])
                jobs[(key, flag)] = [pool.submit(verdict, a, flag, arg) for a in argvs]
    wrong = []
    for (key, flag), futures in sorted(jobs.items()):
        said = [f.result() for f in futures]
        listed = flag in helps[key]
        if any(s.startswith(("took", "unclear")) for s in said):
            wrong.append("%s %s: %s" % (key, flag, said))
        elif listed and "accepted" not in said:
            wrong.append("%s --help lists %s, but it is refused" % (key, flag))
        elif not listed and "accepted" in said:
            wrong.append("%s takes %s, but its --help does not list it" % (key, flag))
    assert not wrong, "\n".join(wrong)
    # The finding itself: run's help names the one transport run takes.
    run_help = pdserve(["run", "--help"]).stdout
    assert "ucx" not in run_help and "--transfer-backend loopback" in run_help, run_help


# ---- unknown and inapplicable options ----------------------------------------------------

def refused(args, *words):
    r = pdserve(args)
    assert r.returncode == 2, (args, r.returncode, r.stdout, r.stderr)
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1, (args, r.stderr)
    for w in words:
        assert w in lines[0], (args, w, lines[0])
    return lines[0]


def test_unknown_and_inapplicable_options_are_refused_with_a_hint():
    refused(["serve", "--foo"], "pdserve serve: unknown option '--foo'")
    refused(["decode", "--model-pth", "x"], "pdserve decode: unknown option '--model-pth'",
            "did you mean --model-path?")
    refused(["prefill", "--disable-radix"], "did you mean --disable-radix-cache?")
    refused(["router", "--polcy", "x"], "pdserve router: unknown option '--polcy'",
            "did you mean --policy?")
    refused(["router", "--model-path", "x"], "an option of the node commands")
    refused(["serve", "--prefill", "http://127.0.0.1:1"], "an option of pdserve router")
    refused(["serve", "--tp-size", "2"], "no tensor parallelism")
    refused(["serve", "--mem-fraction-static", "0.8"], "--max-total-tokens")
    refused(["generate", "--prompt", "x", "--bogus"], "pdserve generate: unknown option '--bogus'")
    refused(["generate", "--promt", "x"], "did you mean --prompt?")
    refused(["sim", "--sedd", "1"], "pdserve sim: unknown option '--sedd'", "did you mean --seed?")
    refused(["model", "init", "--out", "x", "--page-size", "4"], "option only for info")
    # Options of another role are refused by name, with the role they belong to.
    refused(["decode", "--optimistic-attempts", "2"], "pdserve decode: --optimistic-attempts",
            "does not apply", "prefill")
    refused(["decode", "--disable-overlap-schedule"], "--disable-overlap-schedule does not apply")
    for flag in (["--disaggregation-bootstrap-port", "9000"], ["--bootstrap-host", "0.0.0.0"],
                 ["--insecure-bootstrap"], ["--optimistic-attempts", "1"]):
        refused(["serve"] + flag, "pdserve serve: %s does not apply" % flag[0],
                "--disaggregation-mode prefill")
        refused(["decode"] + flag, "pdserve decode: %s does not apply" % flag[0])
    refused(["serve", "--prefill-peers", "127.0.0.1:1"], "--disaggregation-mode decode")
    refused(["prefill", "--prefill-peers", "127.0.0.1:1"], "does not apply", "decode nodes")
    refused(["decode", "--transfer-copy-threads", "2"], "does not apply", "prefill node's UCX")
    refused(["run", "--transfer-copy-threads", "2"], "pdserve run: --transfer-copy-threads")
    for bad in ("0", "9", "two"):
        refused(["prefill", "--transfer-copy-threads", bad], "--transfer-copy-threads", "1 to 8")
    for flag in (["--transfer-backend", "ucx"], ["--disaggregation-transfer-backend", "ucx"],
                 ["--bootstrap-timeout-ms", "5"], ["--bootstrap-token", "s"]):
        refused(["serve"] + flag, "pdserve serve: %s does not apply" % flag[0])
    refused(["run", "--bootstrap-token", "s"], "pdserve run: --bootstrap-token does not apply")
    refused(["run", "--disaggregation-mode", "prefill"], "starts both roles")
    refused(["run", "--transfer-backend", "ucx"], "loopback is the only transport")
    refused(["prefill", "--disaggregation-mode", "decode"], "contradicts the command")
    refused(["serve", "--disaggregation-mode", "both"], "prefill, decode or null")
    refused(["serve", "--strict=yes"], "--strict takes no value")
    # --disaggregation-mode makes the role's options apply to serve, wherever it stands.
    for args in (["serve", "--disaggregation-mode", "decode", "--prefill-peers", "127.0.0.1:1"],
                 ["serve", "--insecure-bootstrap", "--disaggregation-mode=prefill"]):
        assert "'--zzz-a'" in refused(args + ["--zzz-a"], "pdserve serve: unknown option")


# ---- --disaggregation-mode ----------------------------------------------------------------

def test_serve_with_disaggregation_mode_runs_that_role():
    """SGLang's launch_server spelling: serve --disaggregation-mode prefill and
    decode are a prefill and a decode node (their roles on /health, their
    default transport), and behind a router they answer what `pdserve
    generate` computes; null is a colocated serve."""
    boot = pdtest.free_port()
    p = Server(["serve", "--strict", "--disaggregation-mode", "prefill",
                "--disaggregation-bootstrap-port", str(boot)], env=UCX_ENV, name="serve-prefill")
    d = Server(["serve", "--strict", "--disaggregation-mode=decode"], env=UCX_ENV,
               name="serve-decode")
    c = Server(["serve", "--strict", "--disaggregation-mode", "null"], name="serve-null")
    r = None
    try:
        for node, role in ((p, "prefill"), (d, "decode"), (c, "serve")):
            st, h = node.get("/health")
            assert st == 200 and h["role"] == role, (role, st, h)
            assert node.info()["role"] == role
        assert "pdserve serve as prefill listening on" in p.output(), p.output()
        assert "(bootstrap port %d)" % boot in p.output(), p.output()
        r = Server(["router", "--prefill", "http://127.0.0.1:%d@%d" % (p.port, boot),
                    "--decode", "http://127.0.0.1:%d" % d.port, "--health-interval-ms", "200"],
                   name="router")
        for i, prompt in enumerate(pdtest.prompts(4)):
            want = pdtest.generate_reference(prompt, 3 + i)
            st, res = r.post("/generate", {"text": prompt,
                                           "sampling_params": {"max_new_tokens": 3 + i}})
            assert st == 200 and res["output_ids"] == want, (st, res, want)
        p.wait_idle_clean()
        d.wait_idle_clean()
    finally:
        for s in (r, c, d, p):
            if s:
                s.stop()


# ---- --api-key ----------------------------------------------------------------------------

def call(port, method, path, body=None, key=None, raw_auth=None):
    c = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
    headers = {"Content-Type": "application/json"}
    if key is not None:
        headers["Authorization"] = "Bearer " + key
    if raw_auth is not None:
        headers["Authorization"] = raw_auth
    c.request(method, path, body=json.dumps(body) if body is not None else None, headers=headers)
    r = c.getresponse()
    payload = r.read()
    c.close()
    try:
        obj = json.loads(payload) if payload else None
    except ValueError:
        obj = payload.decode("utf-8", "replace")
    return r.status, obj, r.getheader("WWW-Authenticate")


GEN = {"text": "Hello there", "sampling_params": {"max_new_tokens": 4}}


def check_key_required(port, key, generate_path="/generate"):
    for k, raw in ((None, None), ("wrong", None), (None, "Basic " + key), (key + "x", None)):
        st, obj, www = call(port, "POST", generate_path, GEN, key=k, raw_auth=raw)
        assert st == 401 and www == "Bearer", (k, raw, st, obj, www)
        assert obj["error"]["type"] == "authentication_error", obj
        assert "Authorization: Bearer" in obj["error"]["message"], obj
        assert key not in json.dumps(obj), obj  # the key is never echoed
    for path in ("/server_info", "/v1/models", "/no/such/path"):
        st, obj, _ = call(port, "GET", path)
        assert st == 401, (path, st, obj)
    st, obj, _ = call(port, "GET", "/health")  # load balancers' probes need no key
    assert st == 200, (st, obj)
    st, obj, _ = call(port, "POST", generate_path, GEN, key=key)
    assert st == 200 and obj["meta_info"]["completion_tokens"] == 4, (st, obj)
    st, _, _ = call(port, "GET", "/no/such/path", key=key)
    assert st == 404


def test_api_key_on_a_node():
    key = "sk-pdserve-0123456789"
    srv = Server(["serve", "--strict", "--enable-metrics", "--api-key", key])
    try:
        check_key_required(srv.port, key)
        st, _, _ = call(srv.port, "GET", "/metrics")  # Prometheus needs no key (SGLang's rule)
        assert st == 200
        st, obj, _ = call(srv.port, "POST", "/v1/completions",
                          {"prompt": "hi", "max_tokens": 2}, key=key)
        assert st == 200 and obj["usage"]["completion_tokens"] == 2, (st, obj)
        st, info, _ = call(srv.port, "GET", "/server_info", key=key)
        assert st == 200 and info["idle"], info
        assert key not in json.dumps(info)
    finally:
        srv.stop()
    out = pdserve(["serve", "--api-key", "has space"])
    assert out.returncode == 2 and "visible ASCII" in out.stderr and "has space" not in out.stderr


def test_api_key_through_the_router_of_run():
    """run --api-key: the router asks its clients for the key and sends it to
    its nodes, which ask for it too (so the router's 200 proves it sent it)."""
    key = "run-key-42"
    run = Server(["run", "--strict", "--api-key=" + key, "--log-level", "info"], name="run")
    try:
        check_key_required(run.port, key)
        st, obj, _ = call(run.port, "POST", "/v1/chat/completions",
                          {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 3},
                          key=key)
        assert st == 200, (st, obj)
        ports = [int(p) for p in re.findall(r"node http://127\.0\.0\.1:(\d+)", run.output())]
        assert len(ports) == 2, run.output()
        for port in ports:
            st, obj, _ = call(port, "POST", "/generate", GEN)
            assert st == 401, (port, st, obj)
            st, obj, _ = call(port, "GET", "/health")
            assert st == 200
        assert "-H 'Authorization: Bearer KEY'" in run.output() and key not in run.output()
        # What the router sends the nodes besides generations carries the key
        # too: the model list it relays, the aborts it fans out.
        st, obj, _ = call(run.port, "GET", "/v1/models", key=key)
        assert st == 200 and obj["data"][0]["id"], (st, obj)
        check_aborts_reach_the_nodes(run.port, ports, key)
    finally:
        run.stop()


def check_aborts_reach_the_nodes(port, node_ports, key):
    """A stream under way, aborted through the router: the router's
    /abort_request to the nodes carries the key (not 401), the stream ends
    aborted, and the nodes end idle and clean."""
    c = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
    c.request("POST", "/generate", body=json.dumps({
        "text": "abort me", "rid": "keyed-abort", "stream": True,
        "sampling_params": {"max_new_tokens": 4000, "ignore_eos": True}}),
        headers={"Authorization": "Bearer " + key})
    r = c.getresponse()
    assert r.status == 200, r.status
    first = r.readline()
    assert first.startswith(b"data: "), first  # the decode node is generating
    st, obj, _ = call(port, "POST", "/abort_request", {"rid": "keyed-abort"}, key=key)
    assert st == 200 and obj["aborted"] >= 1, (st, obj)
    # Not 401: the key went along (a prefill node done with the request says 404).
    assert all(w["status"] in (200, 404) for w in obj["workers"]), obj
    assert [w["status"] for w in obj["workers"] if w["role"] == "decode"] == [200], obj
    events = [json.loads(line[6:]) for line in r.read().split(b"\n")
              if line.startswith(b"data: {")]
    c.close()
    assert events[-1]["meta_info"]["finish_reason"]["type"] == "abort", events[-1]
    for p in node_ports:
        deadline = time.time() + 30
        while True:
            st, info, _ = call(p, "GET", "/server_info", key=key)
            if st == 200 and info["idle"] and info["idle_clean"]:
                break
            assert time.time() < deadline, (p, st, info)
            time.sleep(0.05)


# ---- --context-length ---------------------------------------------------------------------

def test_context_length_bounds_prompt_and_output():
    srv = Server(["serve", "--strict", "--context-length", "40"])
    try:
        prompt = "a" * 30  # 31 tokens with the begin token
        for body, words in (
                ({"text": prompt, "sampling_params": {"max_new_tokens": 10}},
                 "'max_new_tokens' = 10 exceed the context length of 40"),
                ({"text": "b" * 45, "sampling_params": {"max_new_tokens": 1}},
                 "the prompt is 46 tokens, the context length 40"),
        ):
            st, obj = srv.post("/generate", body)
            assert st == 400 and words in obj["error"]["message"], (st, obj)
            assert "--context-length" in obj["error"]["message"], obj
        st, obj = srv.post("/v1/completions", {"prompt": prompt, "max_tokens": 20})
        assert st == 400 and "'max_tokens' = 20" in obj["error"]["message"], (st, obj)
        st, obj = srv.post("/generate", {"text": prompt, "sampling_params": {
            "max_new_tokens": 9, "ignore_eos": True}})
        assert st == 200 and obj["meta_info"]["completion_tokens"] == 9, (st, obj)
        # A default max_new_tokens (128) is cut to what the context leaves.
        st, obj = srv.post("/generate", {"text": prompt, "sampling_params": {"ignore_eos": True}})
        assert st == 200 and obj["meta_info"]["completion_tokens"] == 9, (st, obj)
        cfg = srv.info()["config"]
        assert cfg["context_length"] == 40 and cfg["max_new_tokens"] == 39, cfg
        srv.wait_idle_clean()
    finally:
        srv.stop()


# ---- --log-level -------------------------------------------------------------------------

def quiet_then_stop(args, **kw):
    s = Server(args, **kw)
    s.stop()
    with open(s.log_path) as f:
        return f.read()


def test_log_level_filters_what_is_printed():
    out = quiet_then_stop(["serve", "--log-level", "warning"])
    assert "listening" not in out and "shutting down" not in out, out
    out = quiet_then_stop(["serve", "--log-level=DEBUG", "--context-length", "64"])
    assert "listening on" in out and "context length 64" in out and "api key none" in out, out
    out = quiet_then_stop(["serve", "--api-key", "k1", "--log-level", "debug"])
    assert "api key set" in out and "k1" not in out, out
    out = quiet_then_stop(["run", "--log-level", "error"], name="run")
    assert "send requests" not in out and "listening" not in out, out
    # A router with no healthy pair answers /health 503: listening, nothing said.
    r = Server(["router", "--log-level", "warn", "--prefill", "http://127.0.0.1:1",
                "--decode", "http://127.0.0.1:2"], wait=False)
    try:
        deadline = time.time() + 30
        while True:
            try:
                if call(r.port, "GET", "/health")[0] == 503:
                    break
            except OSError:
                pass
            assert time.time() < deadline, r.output()
            time.sleep(0.05)
    finally:
        r.stop()
    with open(r.log_path) as f:
        out = f.read()
    assert "listening" not in out and "stopping" not in out, out
    # The request log is info, as SGLang's --log-requests is.
    for level, shown in (("info", True), ("warning", False)):
        s = Server(["serve", "--log-requests", "--log-level", level])
        try:
            assert s.post("/generate", GEN)[0] == 200
        finally:
            s.stop()
        with open(s.log_path) as f:
            out = f.read()
        assert ('"outcome":"finished"' in out) == shown, (level, out)
    for cmd in (["serve"], ["decode"], ["run"], ["router", "--prefill", "http://127.0.0.1:1",
                                                   "--decode", "http://127.0.0.1:2"]):
        r = pdserve(cmd + ["--log-level", "verbose"])
        assert r.returncode == 2 and "debug, info, warning (or warn) or error" in r.stderr, (
            cmd, r.stderr)


# ---- the router's sgl-router form ---------------------------------------------------------

def test_router_takes_sgl_routers_pd_form():
    """sgl-router's `--pd-disaggregation --prefill URL BOOTSTRAP_PORT --decode
    URL`, beside pdserve's URL@PORT, end to end: the nodes of a `run
    --no-router`, a router started the sgl-router way in front of them."""
    pport, dport = pdtest.free_port(), pdtest.free_port()
    nodes = Server(["run", "--strict", "--no-router", "--prefill-port=%d" % pport,
                    "--decode-port", str(dport)], port_flag="--port", name="nodes", wait=False)
    r = None
    try:
        for port in (pport, dport):
            deadline = time.time() + 60
            while True:
                try:
                    if call(port, "GET", "/health")[0] == 200:
                        break
                except OSError:
                    pass
                assert time.time() < deadline and nodes.proc.poll() is None, nodes.output()
                time.sleep(0.05)
        r = Server(["router", "--pd-disaggregation", "--prefill", "http://127.0.0.1:%d" % pport,
                    "12345", "--decode", "http://127.0.0.1:%d" % dport,
                    "--request-timeout-secs", "30", "--max-payload-size=65536"], name="router")
        info = r.info()
        workers = {w["role"]: w for w in info["workers"]}
        assert workers["prefill"]["bootstrap_port"] == 12345, info
        assert info["config"]["request_timeout_ms"] == 30000, info["config"]
        assert info["config"]["max_body_bytes"] == 65536, info["config"]
        for i, prompt in enumerate(pdtest.prompts(3)):
            want = pdtest.generate_reference(prompt, 4 + i)
            st, res = r.post("/generate", {"text": prompt,
                                           "sampling_params": {"max_new_tokens": 4 + i}})
            assert st == 200 and res["output_ids"] == want, (st, res, want)
    finally:
        if r:
            r.stop()
        nodes.stop()
    refused(["router", "--prefill", "http://127.0.0.1:1@9", "10", "--decode", "http://127.0.0.1:2"],
            "two bootstrap ports")


if __name__ == "__main__":
    pdtest.run_tests([
        test_unknown_and_inapplicable_options_are_refused_with_a_hint,
        test_help_lists_exactly_the_options_each_command_takes,
        test_serve_with_disaggregation_mode_runs_that_role,
        test_api_key_on_a_node,
        test_api_key_through_the_router_of_run,
        test_context_length_bounds_prompt_and_output,
        test_log_level_filters_what_is_printed,
        test_router_takes_sgl_routers_pd_form,
    ])
