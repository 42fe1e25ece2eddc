"""A stand-in for the Hugging Face hub on loopback, for the fit check's fetch of a model's config.json: it answers
`HEAD` and `GET /{repo}/resolve/{revision}/{file}` the way huggingface_hub asks for a file (the commit and ETag
headers it reads), and the hub's errors by their `X-Error-Code` (RepoNotFound, RevisionNotFound, EntryNotFound,
GatedRepo). Point HF_ENDPOINT at its `url`.

Its repositories hold only config.json files: published configs of the models the tests name. A gated repository
answers only a request with its token. Every request is recorded (`requests`): what was asked for, and with which
token. `silent_endpoint()` is a listening port that never answers, for a hub that hangs.

`hub_server`: one per test run (registered as a plugin in conftest.py); `hub`: that server, HF_ENDPOINT pointed at it
and its request log emptied, for one test.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import re
import socket
import threading
from collections.abc import Iterator
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import pytest

from tests.support.ports import LOOPBACK

# Published config.json of the models the tests name (their shape only; the rest of each file left out).
QWEN3_06B = {"architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "hidden_size": 1024,
             "num_hidden_layers": 28, "vocab_size": 151936, "intermediate_size": 3072, "num_attention_heads": 16,
             "num_key_value_heads": 8, "head_dim": 128, "tie_word_embeddings": True, "torch_dtype": "bfloat16"}
QWEN25_7B = {"architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2", "hidden_size": 3584,
             "num_hidden_layers": 28, "vocab_size": 152064, "intermediate_size": 18944, "num_attention_heads": 28,
             "num_key_value_heads": 4, "tie_word_embeddings": False, "torch_dtype": "bfloat16"}
QWEN25_32B = {"architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2", "hidden_size": 5120,
              "num_hidden_layers": 64, "vocab_size": 152064, "intermediate_size": 27648, "num_attention_heads": 40,
              "num_key_value_heads": 8, "tie_word_embeddings": False, "torch_dtype": "bfloat16"}
GATED_TOKEN = "hf_stand_in_token"
_RESOLVE = re.compile(r"^/(?P<repo>[^/]+(?:/[^/]+)?)/resolve/(?P<revision>[^/]+)/(?P<file>.+)$")


@dataclass
class Repo:
    files: dict[str, bytes]
    revisions: tuple[str, ...] = ("main",)
    token: str | None = None  # gated: only a request with this token is answered


@dataclass
class HubServer:
    repos: dict[str, Repo] = field(default_factory=dict)
    requests: list[tuple[str, str, str | None]] = field(default_factory=list)  # (method, path, bearer token)

    def __post_init__(self) -> None:
        hub = self

        class Handler(BaseHTTPRequestHandler):
            def do_HEAD(self) -> None:
                self._answer(body=False)

            def do_GET(self) -> None:
                self._answer(body=True)

            def _answer(self, body: bool) -> None:
                token = self.headers.get("Authorization", "").removeprefix("Bearer ") or None
                hub.requests.append((self.command, self.path, token))
                status, headers, content = hub.answer(self.path, token)
                self.send_response(status)
                for name, value in {**headers, "Content-Length": str(len(content))}.items():
                    self.send_header(name, value)
                self.end_headers()
                if body:
                    self.wfile.write(content)

            def log_message(self, *args: Any) -> None:
                pass

        self.server = ThreadingHTTPServer((LOOPBACK, 0), Handler)
        self.url = f"http://{LOOPBACK}:{self.server.server_address[1]}"
        self.thread = threading.Thread(target=self.server.serve_forever, name="hub-server", daemon=True)
        self.thread.start()

    def add(self, repo: str, config: dict[str, Any], *, revisions: tuple[str, ...] = ("main",),
            token: str | None = None) -> None:
        self.repos[repo] = Repo({"config.json": json.dumps(config).encode()}, revisions, token)

    def answer(self, path: str, token: str | None) -> tuple[int, dict[str, str], bytes]:
        match = _RESOLVE.match(path.split("?")[0])
        repo = self.repos.get(match["repo"]) if match else None
        if repo is None:
            return self._error(404, "RepoNotFound", "Repository not found")
        if repo.token is not None and token != repo.token:
            return self._error(401, "GatedRepo", "Access to this model is restricted")
        if match["revision"] not in repo.revisions:
            return self._error(404, "RevisionNotFound", "Invalid rev id")
        content = repo.files.get(match["file"])
        if content is None:
            return self._error(404, "EntryNotFound", "Entry not found")
        commit = hashlib.sha1(f"{match['repo']}@{match['revision']}".encode()).hexdigest()
        etag = hashlib.sha256(content).hexdigest()
        return 200, {"Content-Type": "application/json", "ETag": f'"{etag}"', "X-Repo-Commit": commit}, content

    @staticmethod
    def _error(status: int, code: str, message: str) -> tuple[int, dict[str, str], bytes]:
        body = json.dumps({"error": message}).encode()
        return status, {"Content-Type": "application/json", "X-Error-Code": code, "X-Error-Message": message}, body

    def stop(self) -> None:
        self.server.shutdown()
        self.server.server_close()


@contextlib.contextmanager
def silent_endpoint() -> Iterator[str]:
    """The URL of a port that accepts connections (the kernel's backlog) and never answers: a hub that hangs."""
    with socket.socket() as listener:
        listener.bind((LOOPBACK, 0))
        listener.listen(8)
        yield f"http://{LOOPBACK}:{listener.getsockname()[1]}"


@pytest.fixture(scope="session")
def hub_server() -> Iterator[HubServer]:
    server = HubServer()
    server.add("Qwen/Qwen3-0.6B", QWEN3_06B)
    server.add("Qwen/Qwen2.5-7B", QWEN25_7B, revisions=("main", "v1.0"))
    server.add("Qwen/Qwen2.5-32B", QWEN25_32B)
    server.add("meta-llama/Gated-7B", QWEN25_7B, token=GATED_TOKEN)
    yield server
    server.stop()


@pytest.fixture
def hub(hub_server: HubServer, monkeypatch) -> HubServer:
    monkeypatch.setenv("HF_ENDPOINT", hub_server.url)
    monkeypatch.delenv("HF_TOKEN", raising=False)
    hub_server.requests.clear()
    return hub_server
