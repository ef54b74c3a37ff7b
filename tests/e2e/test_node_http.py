"""End-to-end: a node's HTTP layer (pd_http_server, docs/http-server.md)
refuses what libmicrohttpd answered itself in HTML, in the project's JSON
error shape, and cuts slow clients at their deadlines (issue 10, findings 3
and 8). Each test failed on the libmicrohttpd node: its 431, bad framing,
HTTP/0.9 and 505 answers had HTML bodies, and a request trickled a byte at a
time held its connection for as long as the trickle went on."""
import json
import socket
import time

import pdtest
from pdtest import Server


def exchange(port, data, timeout=10):
    """Sends data as it is; returns (status, headers dict, body bytes, closed):
    the first answer, and whether the server then closed the connection."""
    s = socket.create_connection(("127.0.0.1", port))
    s.settimeout(timeout)
    answer = b""
    closed = False
    try:
        s.sendall(data)
        while True:
            chunk = s.recv(65536)
            if not chunk:
                closed = True
                break
            answer += chunk
    except OSError:
        pass
    finally:
        s.close()
    return parse_answer(answer) + (closed,)


def parse_answer(answer):
    head, _, body = answer.partition(b"\r\n\r\n")
    lines = head.split(b"\r\n")
    if not lines[0].startswith(b"HTTP/1."):
        return 0, {}, b""
    headers = {}
    for line in lines[1:]:
        k, _, v = line.partition(b":")
        headers[k.strip().lower().decode()] = v.strip().decode()
    return int(lines[0].split(b" ", 2)[1]), headers, body


def assert_json_error(status, headers, body, closed, want, data=b""):
    assert status == want, (data[:80], status, headers, body[:300])
    assert headers.get("content-type") == "application/json", (data[:80], headers)
    assert headers.get("connection") == "close", (data[:80], headers)
    obj = json.loads(body)
    err = obj["error"]
    assert err["code"] == want and err["type"] and err["message"], (data[:80], obj)
    assert closed, "the connection stayed open after %d" % want
    return err["message"]


# Requests libmicrohttpd refused with its own HTML body.
MALFORMED = (
    (b"GET /health HTTP/1.1\r\nHost: x\r\nX-Big: " + b"a" * 65536 + b"\r\n\r\n", 431),
    (b"POST /generate HTTP/1.1\r\nHost: x\r\nContent-Length: abc\r\n\r\n{}", 400),
    (b"POST /generate HTTP/1.1\r\nHost: x\r\nContent-Length: -1\r\n\r\n{}", 400),
    (b"POST /generate HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\nzz\r\n{}\r\n0\r\n\r\n", 400),
    (b"POST /generate HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n2\r\n{}XX0\r\n\r\n", 400),
    (b"GET /health\r\n\r\n", 505),  # an HTTP/0.9 request line
    (b"GET /health HTTP/0.9\r\n\r\n", 505),
    (b"GET /health HTTP/2.0\r\nHost: x\r\n\r\n", 505),
)


def test_malformed_requests_get_a_json_error():
    srv = Server(["serve", "--strict"])
    try:
        for data, want in MALFORMED:
            assert_json_error(*exchange(srv.port, data), want=want, data=data)
        st, obj = srv.get("/health")
        assert st == 200 and obj["status"] == "ok"
        info = srv.wait_idle_clean()
        assert info["counters"]["submitted"] == 0, info["counters"]
    finally:
        srv.stop()


def trickle(port, head, drip, seconds):
    """Sends head, then drip one byte each 50 ms for up to `seconds`, reading
    as it goes; returns (status, headers, body, closed, seconds the trickle
    lasted) once the server answered and closed, or the time ran out."""
    s = socket.create_connection(("127.0.0.1", port))
    s.settimeout(0.05)
    t0 = time.time()
    answer = b""
    closed = False
    s.sendall(head)
    i = 0
    while time.time() - t0 < seconds and not closed:
        try:
            s.sendall(drip[i % len(drip):i % len(drip) + 1])
            i += 1
        except OSError:
            pass  # the server shut its side: read what it said
        try:
            chunk = s.recv(65536)
            if chunk:
                answer += chunk
            else:
                closed = True
        except socket.timeout:
            pass
        except OSError:
            closed = True
    s.close()
    return parse_answer(answer) + (closed, time.time() - t0)


def test_slowloris_header_is_cut_at_the_header_deadline():
    # 400 ms for the header block; the trickle would go on for 8 s.
    srv = Server(["serve", "--strict", "--http-header-timeout-ms", "400"])
    try:
        status, headers, body, closed, lasted = trickle(
            srv.port, b"GET /health HTTP/1.1\r\nHost: x\r\n", b"X-Slow: abcdefghijklmnopqrstuvwxyz\r\n", 8)
        msg = assert_json_error(status, headers, body, closed, want=408)
        assert "header" in msg, msg
        assert lasted < 6, "cut after %.1f s, not at the 400 ms deadline" % lasted
        st, obj = srv.get("/health")  # a fresh connection has its own deadline
        assert st == 200
    finally:
        srv.stop()


def test_slow_body_is_cut_at_the_body_deadline():
    # 400 ms for the body once the headers are in; the trickle would go on for 8 s.
    srv = Server(["serve", "--strict", "--http-body-timeout-ms", "400"])
    try:
        body = json.dumps({"text": "slow", "sampling_params": {"max_new_tokens": 2}}).encode() + b" " * 400
        head = (b"POST /generate HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                b"Content-Length: %d\r\n\r\n" % len(body))
        status, headers, got, closed, lasted = trickle(srv.port, head, body, 8)
        msg = assert_json_error(status, headers, got, closed, want=408)
        assert "body" in msg, msg
        assert lasted < 6, "cut after %.1f s, not at the 400 ms deadline" % lasted
        info = srv.wait_idle_clean()
        assert info["counters"]["submitted"] == 0, info["counters"]  # never reached the engine
    finally:
        srv.stop()


def test_idle_keep_alive_connection_is_closed():
    srv = Server(["serve", "--strict", "--http-idle-timeout-ms", "300"])
    try:
        s = socket.create_connection(("127.0.0.1", srv.port))
        s.settimeout(10)
        s.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
        answer = b""
        while b"\r\n\r\n" not in answer:
            answer += s.recv(65536)
        assert answer.startswith(b"HTTP/1.1 200"), answer
        t0 = time.time()
        rest = b""
        while True:  # the body, then the silent close
            chunk = s.recv(65536)
            if not chunk:
                break
            rest += chunk
        s.close()
        assert time.time() - t0 < 8, "an idle connection was kept past its deadline"
    finally:
        srv.stop()


def test_a_slow_stream_reader_gets_every_event():
    """A client that reads its event stream late still gets every token, in
    order, then [DONE]; meanwhile the node answers others."""
    srv = Server(["serve", "--strict"])
    try:
        prompt = "a slow reader"
        want = pdtest.generate_reference(prompt, 1500, ["--ignore-eos"])
        s = socket.socket()
        s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        s.connect(("127.0.0.1", srv.port))
        s.settimeout(60)
        body = json.dumps({"text": prompt, "stream": True,
                           "sampling_params": {"max_new_tokens": 1500, "ignore_eos": True}}).encode()
        s.sendall(b"POST /generate HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                  b"Content-Length: %d\r\n\r\n" % len(body) + body)
        deadline = time.time() + 20
        while time.time() < deadline and srv.info()["counters"]["finished"] < 1:
            st, obj = srv.get("/health")
            assert st == 200
            time.sleep(0.05)
        data = b""
        while not data.endswith(b"0\r\n\r\n"):
            chunk = s.recv(65536)
            if not chunk:
                break
            data += chunk
        s.close()
        head, _, chunked = data.partition(b"\r\n\r\n")
        assert head.startswith(b"HTTP/1.1 200") and b"text/event-stream" in head, head
        stream = b""
        while True:  # undo the chunked framing
            size_line, _, chunked = chunked.partition(b"\r\n")
            size = int(size_line, 16)
            if size == 0:
                break
            stream += chunked[:size]
            chunked = chunked[size + 2:]
        events = [e[6:].decode() for e in stream.split(b"\n\n") if e]
        assert events[-1] == "[DONE]", events[-2:]
        ids = pdtest.stream_ids([json.loads(e) for e in events[:-1]])
        assert ids == want, (len(ids), len(want))
        srv.wait_idle_clean()
    finally:
        srv.stop()


if __name__ == "__main__":
    pdtest.run_tests([
        test_malformed_requests_get_a_json_error,
        test_slowloris_header_is_cut_at_the_header_deadline,
        test_slow_body_is_cut_at_the_body_deadline,
        test_idle_keep_alive_connection_is_closed,
        test_a_slow_stream_reader_gets_every_event,
    ])
