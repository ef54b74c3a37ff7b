"""Helpers for pdserve's end-to-end tests: start servers on free ports of
127.0.0.1, talk HTTP to them with the standard library only, and run test
functions with a plain summary line ("N passed, M failed").

Every server is started with --strict (the ownership check runs after every
scheduler step) and stopped at the end; a test never touches anything but
127.0.0.1.
"""
import http.client
import json
import os
import random
import signal
import socket
import shutil
import subprocess
import sys
import time
import traceback

PDSERVE = os.environ.get("PDSERVE") or sys.argv[1]


def _ephemeral_low():
    """The lowest port the kernel hands to outgoing connections."""
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            return int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


_ports = random.Random(os.getpid() * 1000003 + time.time_ns())
# Ports free_port hands out first, before drawing (tests of the harness).
next_ports = []


def free_port():
    """A port of 127.0.0.1 nothing is bound to now, for a server to listen on.

    Drawn below the kernel's ephemeral range: a port from bind(0) is one the
    kernel also gives outgoing connections (a router's to its nodes, a
    client's), and one of those could take it between this check and the
    server's own bind. That race failed e2e_reference under ThreadSanitizer
    ("cannot listen on 127.0.0.1:43177: Address already in use"). Another
    test running alongside may still draw the same port; Server starts again
    on a new one when its bind fails."""
    if next_ports:
        return next_ports.pop(0)
    high = _ephemeral_low()
    low = max(1024, high - 12000)
    for _ in range(200):
        port = _ports.randrange(low, high)
        s = socket.socket()
        try:
            s.bind(("127.0.0.1", port))
            return port
        except OSError:
            continue
        finally:
            s.close()
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    return port


PORT_CLASH = "Address already in use"


class Server:
    """A pdserve process (serve, prefill, decode, router or run). With no
    port given it takes a free one, and starts again on another (up to
    three times) if its listen fails because something took that port in
    the meantime."""

    own_port = False  # the harness chose the port (a restart may choose another)
    restarts = 0

    def __init__(self, args, port_flag="--port", env=None, wait=True, name=None, port=None):
        self.name = name or args[0]
        self.cmd_tail = (list(args), port_flag)
        self.full_env = dict(os.environ)
        if env:
            self.full_env.update(env)
        self.own_port = port is None
        self.port = port or free_port()
        self.start()
        if wait:
            self.wait_healthy()

    def start(self):
        args, port_flag = self.cmd_tail
        cmd = [PDSERVE] + args + [port_flag, str(self.port)]
        self.log_path = "/tmp/pdserve-e2e-%s-%d.log" % (self.name, self.port)
        self.log = open(self.log_path, "w")
        self.proc = subprocess.Popen(cmd, stdout=self.log, stderr=subprocess.STDOUT, env=self.full_env)

    def clashed(self):
        """Whether the process ended because its port was taken (then, if the
        port was ours to choose, it has been started again on a new one)."""
        if not self.own_port or self.restarts >= 3 or self.proc.poll() is None or \
                PORT_CLASH not in self.output():
            return False
        self.restarts += 1
        self.log.close()
        self.port = free_port()
        self.start()
        return True

    def wait_healthy(self, timeout=60):
        deadline = time.time() + timeout
        while time.time() < deadline:
            if self.proc.poll() is not None and not self.clashed():
                raise AssertionError("%s exited with %d:\n%s" % (self.name, self.proc.returncode, self.output()))
            try:
                st, _ = self.get("/health", timeout=2)
                if st == 200:
                    return
            except OSError:
                pass
            time.sleep(0.05)
        raise AssertionError("%s did not become healthy:\n%s" % (self.name, self.output()))

    def output(self):
        self.log.flush()
        with open(self.log_path) as f:
            return f.read()[-4000:]

    def conn(self, timeout=120):
        return http.client.HTTPConnection("127.0.0.1", self.port, timeout=timeout)

    def request(self, method, path, body=None, timeout=120, raw=None):
        c = self.conn(timeout)
        data = raw if raw is not None else (json.dumps(body) if body is not None else None)
        c.request(method, path, body=data, headers={"Content-Type": "application/json"})
        r = c.getresponse()
        payload = r.read()
        c.close()
        try:
            obj = json.loads(payload) if payload else None
        except ValueError:
            obj = payload.decode("utf-8", "replace")
        return r.status, obj

    def get(self, path, timeout=120):
        return self.request("GET", path, timeout=timeout)

    def post(self, path, body, timeout=120):
        return self.request("POST", path, body, timeout=timeout)

    def stream(self, path, body, timeout=120):
        """POST with stream=true; returns (status, [events]) with the JSON events
        and '[DONE]' as the last element when it came."""
        c = self.conn(timeout)
        c.request("POST", path, body=json.dumps(body), headers={"Content-Type": "application/json"})
        r = c.getresponse()
        events = []
        if r.status != 200:
            payload = r.read()
            c.close()
            return r.status, json.loads(payload)
        buf = b""
        while True:
            chunk = r.read1(65536) if hasattr(r, "read1") else r.read(1)
            if not chunk:
                break
            buf += chunk
            while b"\n\n" in buf:
                ev, buf = buf.split(b"\n\n", 1)
                assert ev.startswith(b"data: "), ev
                data = ev[6:].decode()
                events.append(data if data == "[DONE]" else json.loads(data))
        c.close()
        return r.status, events

    def info(self):
        st, obj = self.get("/server_info")
        assert st == 200, (st, obj)
        return obj

    def wait_idle_clean(self, timeout=30):
        """Until the node is idle with nothing held; returns the last info."""
        deadline = time.time() + timeout
        info = None
        while time.time() < deadline:
            info = self.info()
            if info.get("idle") and info.get("idle_clean"):
                return info
            time.sleep(0.05)
        raise AssertionError("%s not idle-clean: %s" % (self.name, json.dumps(info)[:3000]))

    def stop(self, sig=signal.SIGTERM):
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.log.close()

    def kill(self):
        self.stop(signal.SIGKILL)


def raw_http(port, data, timeout=10):
    """Sends bytes as they are and returns (status, parsed JSON body or None)
    of the first answer; (0, None) if the server closed without one."""
    s = socket.create_connection(("127.0.0.1", port))
    s.settimeout(timeout)
    answer = b""
    try:
        s.sendall(data)
        while True:
            head, sep, rest = answer.partition(b"\r\n\r\n")
            if sep:
                length = 0
                for line in head.split(b"\r\n")[1:]:
                    k, _, v = line.partition(b":")
                    if k.strip().lower() == b"content-length":
                        length = int(v.strip())
                if len(rest) >= length:
                    break
            chunk = s.recv(65536)
            if not chunk:
                break
            answer += chunk
    except OSError:
        pass
    finally:
        s.close()
    if not answer.startswith(b"HTTP/1."):
        return 0, None
    status = int(answer.split(b" ", 2)[1])
    body = answer.partition(b"\r\n\r\n")[2]
    try:
        return status, json.loads(body)
    except ValueError:
        return status, None


# Requests whose framing two HTTP implementations could read differently
# (request smuggling behind a proxy): both servers must refuse each with 400
# in the JSON error shape (issue 10, finding 10).
AMBIGUOUS_REQUESTS = (
    (b"POST /generate HTTP/1.1\r\nHost: x\r\nContent-Length: 2\r\nContent-Length: 3\r\n\r\n{}",
     "Content-Length"),
    (b"POST /generate HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\nContent-Length: 7\r\n\r\n"
     b"2\r\n{}\r\n0\r\n\r\n", "Transfer-Encoding together with Content-Length"),
    (b"POST /generate HTTP/1.1\r\nContent-Length: 2\r\n\r\n{}", "Host"),
)


def check_ambiguous_requests_refused(port):
    for data, words in AMBIGUOUS_REQUESTS:
        st, obj = raw_http(port, data)
        assert st == 400, (data, st, obj)
        assert obj and obj["error"]["code"] == 400 and words in obj["error"]["message"], (data, obj)


def checkpoint_with_tokenizer(tmp, name, config, tokenizer_dir, seed):
    """A random bf16 checkpoint of a built-in config, in two shards, whose
    vocabulary is exactly the ids of tokenizer_dir's tokenizer.json, with
    that tokenizer.json and tokenizer_config.json beside it. Returns
    (directory, vocab)."""
    tok = json.load(open(os.path.join(tokenizer_dir, "tokenizer.json")))
    vocab = 1 + max(max(tok["model"]["vocab"].values()), max(a["id"] for a in tok["added_tokens"]))
    model = os.path.join(tmp, name)
    r = subprocess.run([PDSERVE, "model", "init", "--out", model, "--config", config,
                        "--vocab", str(vocab), "--dtype", "bf16", "--shards", "2",
                        "--seed", str(seed)], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    for f in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(os.path.join(tokenizer_dir, f), model)
    return model, vocab


def generate_reference(prompt, max_new, extra=()):
    """Token ids from `pdserve generate` (the model run offline, alone)."""
    out = subprocess.run([PDSERVE, "generate", "--prompt", prompt, "--max-new-tokens", str(max_new), "--json"]
                         + list(extra), capture_output=True, text=True, check=True)
    return json.loads(out.stdout)["output_ids"]


def stream_ids(events):
    """The token ids of a /generate event stream. Streams are cumulative by
    default (SGLang's): each event carries every id and all the text so far,
    so each event must extend the previous one, and the final event's ids
    are the whole output."""
    prev, prev_text = [], ""
    for e in events:
        if e == "[DONE]" or "output_ids" not in e:
            continue
        ids = e["output_ids"]
        assert ids[:len(prev)] == prev, ("not cumulative", prev, ids)
        assert e["text"].startswith(prev_text), ("text not cumulative", prev_text, e)
        prev, prev_text = ids, e["text"]
    return prev


def run_tests(tests):
    passed = failed = 0
    for t in tests:
        t0 = time.time()
        try:
            t()
            passed += 1
            print("PASS %s (%.1fs)" % (t.__name__, time.time() - t0), flush=True)
        except Exception:
            failed += 1
            print("FAIL %s (%.1fs)" % (t.__name__, time.time() - t0), flush=True)
            traceback.print_exc()
    print("%d passed, %d failed" % (passed, failed))
    sys.exit(1 if failed else 0)


def prompts(n=24):
    """Prompts of mixed lengths (1 to ~300 bytes), deterministic."""
    base = "The quick brown fox jumps over the lazy dog. 0123456789 " * 8
    out = []
    for i in range(n):
        length = [1, 2, 5, 9, 15, 16, 17, 31, 32, 33, 63, 64, 65, 100, 127, 128, 129, 200, 255, 256, 257, 300, 3, 47][i % 24]
        out.append((base[i % 17:] + base)[:length])
    return out


def check_refused_half_ends_its_peer(p, d, boot_port, room_base):
    """Each half of a request (same rid and room on both nodes, as the router
    sends them) where one node refuses its half — bad input at the HTTP layer,
    or a prompt that fits the prefill node but not the decode node's KV pool.
    The nodes run with bootstrap and transfer timeouts far beyond this test's
    patience, so the other half ends in time only because the refusing node
    told it through the transport. Both nodes end idle-clean."""
    import threading

    long_text = "a prompt long enough to overflow a small decode pool " * 14
    cases = [
        # (which node refuses, what it is sent, the status it answers)
        ("decode", {"text": "hello there", "sampling_params": {"max_new_tokens": 4, "temperature": -1}}, 400),
        ("decode", {"text": long_text, "sampling_params": {"max_new_tokens": 700, "ignore_eos": True}}, 413),
        ("prefill", {"text": "hello there", "sampling_params": {"max_new_tokens": "four"}}, 400),
    ]
    before = {n.name: n.info()["counters"].get("rooms_cancelled", 0) for n in (p, d)}
    for i, (refuser, bad, want_status) in enumerate(cases):
        room = room_base + i
        boot = {"bootstrap_room": room, "bootstrap_host": "127.0.0.1", "bootstrap_port": boot_port,
                "rid": "refused-%d" % room}
        good = {"text": bad["text"], "sampling_params": {"max_new_tokens": 4}}
        if refuser == "decode" and want_status == 413:
            good = dict(bad)  # the same body: only the decode node lacks the room for it
        waiting, refusing = (p, d) if refuser == "decode" else (d, p)
        out = {}
        t = threading.Thread(target=lambda: out.setdefault("r", waiting.post("/generate", dict(good, **boot))))
        t.start()
        time.sleep(0.2)  # usually the waiting half is queued first; the other order is covered too
        st, body = refusing.post("/generate", dict(bad, **boot))
        assert st == want_status, (refuser, st, body)
        t.join(30)
        assert not t.is_alive(), "the %s half of room %d still waits for its refused peer" % (waiting.name, room)
        st, body = out["r"]
        assert st >= 500, (waiting.name, st, body)
    for n in (p, d):
        n.wait_idle_clean()
    after = {n.name: n.info()["counters"]["rooms_cancelled"] for n in (p, d)}
    assert after[d.name] - before[d.name] == 2 and after[p.name] - before[p.name] == 1, (before, after)
