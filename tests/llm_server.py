"""A local OpenAI-compatible endpoint for tests: real HTTP over a real socket, scripted replies.

    with ScriptedLLMServer(api_key="k", models={"m"}) as server:
        server.push(reply("```cuda ...```"), error(429, headers={"Retry-After": "2"}))
        client = openai.OpenAI(base_url=server.base_url, api_key="k")

POST /v1/chat/completions answers with the next scripted Step, or with `responder(body)`
when one is given (for conversations whose length the test does not fix). It checks the
bearer key (401, echoing the wrong key back like careless proxies do) and the model (404)
first. GET /v1/models lists the models (unless list_models=False: 404, as on servers
without the route). Every request is recorded with its headers and JSON body.
"""

from __future__ import annotations

import json
import socket
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any, Callable


@dataclass
class Step:
    """One scripted answer: a completion (text) or an HTTP error, optionally late."""

    text: str = ""
    status: int = 200
    message: str = ""  # error message, for status != 200
    headers: dict[str, str] = field(default_factory=dict)
    # (prompt, completion) tokens; None: no usage field; AUTO: 100 and what the text plausibly took
    usage: tuple[int, int] | str | None = "auto"
    finish_reason: str = "stop"
    delay_s: float = 0.0
    reasoning: str | None = None  # sent as message.reasoning_content, as vLLM and DeepSeek do
    body: Any = None  # the whole error body, for shapes other than OpenAI's {"error": {"message"}}


def reply(text: str, usage: tuple[int, int] | str | None = "auto", **kw: Any) -> Step:
    return Step(text=text, usage=usage, **kw)


def error(status: int, message: str = "scripted error", headers: dict[str, str] | None = None,
          body: Any = None) -> Step:
    return Step(status=status, message=message, headers=headers or {}, body=body)


def slow(delay_s: float, step: Step | None = None) -> Step:
    step = step or reply("too late")
    step.delay_s = delay_s
    return step


def closed_port_url() -> str:
    """A 127.0.0.1 endpoint on which nothing listens: connections are refused at once."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    return f"http://127.0.0.1:{port}/v1"


@dataclass
class Request:
    path: str
    headers: dict[str, str]
    body: dict[str, Any]

    @property
    def messages(self) -> list[dict[str, str]]:
        return self.body.get("messages", [])

    @property
    def last_user(self) -> str:
        return next((m["content"] for m in reversed(self.messages) if m["role"] == "user"), "")


class ScriptedLLMServer:
    def __init__(self, api_key: str = "test-key", models: set[str] | None = None,
                 responder: Callable[[dict[str, Any]], Step] | None = None, list_models: bool = True):
        self.api_key = api_key
        self.list_models = list_models
        self.models = models or {"test-model"}
        self.responder = responder
        self.steps: deque[Step] = deque()
        self.requests: list[Request] = []
        self._closing = threading.Event()
        self._lock = threading.Lock()
        self._httpd = ThreadingHTTPServer(("127.0.0.1", 0), self._handler())
        self._httpd.daemon_threads = True
        self._thread = threading.Thread(target=self._httpd.serve_forever, kwargs={"poll_interval": 0.02},
                                        name="llm-test-server", daemon=True)

    @property
    def base_url(self) -> str:
        host, port = self._httpd.server_address[:2]
        return f"http://{host}:{port}/v1"

    def push(self, *steps: Step) -> None:
        with self._lock:
            self.steps.extend(steps)

    def start(self) -> "ScriptedLLMServer":
        self._thread.start()
        return self

    def close(self) -> None:
        self._closing.set()  # wakes slow steps so their threads end now
        self._httpd.shutdown()
        self._httpd.server_close()
        self._thread.join()

    def __enter__(self) -> "ScriptedLLMServer":
        return self.start()

    def __exit__(self, *exc: Any) -> None:
        self.close()

    # ---- one request -------------------------------------------------------------------
    def _next(self, body: dict[str, Any]) -> Step:
        if self.responder is not None:
            return self.responder(body)
        with self._lock:
            return self.steps.popleft() if self.steps else error(500, "test script exhausted: no step left")

    def _answer(self, path: str, headers: dict[str, str], body: dict[str, Any]) -> tuple[int, dict[str, str], dict]:
        with self._lock:
            self.requests.append(Request(path, headers, body))
        routes = {"/v1/chat/completions"} | ({"/v1/models"} if self.list_models else set())
        if path not in routes:
            return 404, {}, _error_body(f"no route {path}", "not_found")
        given = headers.get("authorization", "").removeprefix("Bearer ")
        if given != self.api_key:
            return 401, {}, _error_body(f"Incorrect API key provided: {given}", "invalid_api_key")
        if path == "/v1/models":
            return 200, {}, {"object": "list", "data": [{"id": m, "object": "model", "created": 0, "owned_by": "test"}
                                                        for m in sorted(self.models)]}
        model = body.get("model")
        if model not in self.models:
            return 404, {}, _error_body(f"The model `{model}` does not exist", "model_not_found")
        step = self._next(body)
        if step.delay_s:
            self._closing.wait(step.delay_s)
        if step.status != 200:
            return step.status, step.headers, step.body if step.body is not None else _error_body(step.message,
                                                                                                   "scripted")
        out = {
            "id": f"chatcmpl-{len(self.requests)}", "object": "chat.completion", "created": int(time.time()),
            "model": model,
            "choices": [{"index": 0, "message": {"role": "assistant", "content": step.text},
                         "finish_reason": step.finish_reason}],
        }
        if step.reasoning is not None:
            out["choices"][0]["message"]["reasoning_content"] = step.reasoning
        if step.usage is not None:
            # A real reply takes about a token per 4 characters (the client doubts far fewer).
            p, c = (100, max(50, len(step.text) // 4)) if step.usage == "auto" else step.usage
            out["usage"] = {"prompt_tokens": p, "completion_tokens": c, "total_tokens": p + c}
        return 200, step.headers, out

    def _handler(self) -> type[BaseHTTPRequestHandler]:
        server = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:
                self.do_POST()

            def do_POST(self) -> None:
                raw = self.rfile.read(int(self.headers.get("content-length") or 0))
                body = json.loads(raw or b"{}")
                status, headers, payload = server._answer(self.path, {k.lower(): v for k, v in self.headers.items()},
                                                          body)
                data = json.dumps(payload).encode()
                try:
                    self.send_response(status)
                    self.send_header("content-type", "application/json")
                    self.send_header("content-length", str(len(data)))
                    for k, v in headers.items():
                        self.send_header(k, v)
                    self.end_headers()
                    self.wfile.write(data)
                except (BrokenPipeError, ConnectionResetError):
                    pass  # the client gave up (a timeout test): nothing to answer

            def log_message(self, format: str, *args: Any) -> None:
                pass  # keep test output clean

        return Handler


def _error_body(message: str, code: str) -> dict:
    return {"error": {"message": message, "type": "invalid_request_error", "code": code}}
