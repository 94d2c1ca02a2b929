"""Helpers for the evaluation tests: a real OpenAI-compatible HTTP server over the demo models,
untrained (zero) LoRA adapters, and the upstream manifests an evaluation reads."""

from __future__ import annotations

import json
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

from tests.support import REPO_ROOT


class ModelServer:
    """``POST /v1/completions`` answered by real local models (transformers, greedy), by model name;
    ``POST /v1/load_lora_adapter`` loads a PEFT adapter on top of ``lora_base`` (like vLLM with
    ``--enable-lora``; ``--lora-modules NAME=PATH`` is a load at start); ``GET /v1/models`` lists them with
    their ``root`` and ``parent`` as vLLM does. Fault injection for client tests: a prompt containing ``crash_marker``
    gets
    HTTP 500, one containing ``hang_marker`` is answered only after ``hang_s`` seconds."""

    def __init__(
        self,
        models: dict[str, Path],
        lora_base: Path | None = None,
        crash_marker: str = "CRASH",
        hang_marker: str = "HANG",
        hang_s: float = 3.0,
    ):
        from campaign_orchestrator.generation.local import LocalModel

        self.generators = {name: LocalModel.from_path(path, batch_size=1) for name, path in models.items()}
        self.paths = dict(models)
        self.lora_base = lora_base
        self.crash_marker, self.hang_marker, self.hang_s = crash_marker, hang_marker, hang_s
        self.lock = threading.Lock()  # the counters
        self.gen_lock = threading.Lock()
        self.in_flight = 0
        self.max_in_flight = 0
        self.requests = 0
        self.loaded: dict[str, str] = {}
        server = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args):  # quiet
                pass

            def _send(self, code: int, obj: dict) -> None:
                body = json.dumps(obj).encode()
                self.send_response(code)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def do_GET(self):  # noqa: N802
                if self.path != "/v1/models":
                    return self._send(404, {"error": {"message": f"no route {self.path}"}})
                return self._send(200, server.models())

            def do_POST(self):  # noqa: N802
                req = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                if self.path == "/v1/load_lora_adapter":
                    return self._send(*server.load_lora(req["lora_name"], req["lora_path"]))
                if self.path != "/v1/completions":
                    return self._send(404, {"error": {"message": f"no route {self.path}"}})
                if server.hang_marker in req.get("prompt", ""):  # held past the client's timeout (not counted)
                    time.sleep(server.hang_s)
                    return None
                with server.lock:
                    server.requests += 1
                    server.in_flight += 1
                    server.max_in_flight = max(server.max_in_flight, server.in_flight)
                try:
                    answer = server.complete(req)
                finally:
                    with server.lock:  # before answering, so the client's next request cannot overlap it
                        server.in_flight -= 1
                try:
                    self._send(*answer)
                except (BrokenPipeError, ConnectionResetError):  # the client timed out and went away
                    pass

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.httpd.daemon_threads = True
        self.thread = threading.Thread(target=self.httpd.serve_forever, daemon=True)

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.httpd.server_address[1]}/v1"

    def models(self) -> dict:
        """``GET /v1/models`` as vLLM answers it: base models with ``root`` = their path, LoRA modules with
        ``root`` = the adapter directory and ``parent`` = the base."""
        data = [{"id": n, "object": "model", "root": str(p), "parent": None} for n, p in self.paths.items()]
        data += [{"id": n, "object": "model", "root": p, "parent": str(self.lora_base)} for n, p in self.loaded.items()]
        return {"object": "list", "data": data}

    def load_lora(self, name: str, path: str) -> tuple[int, dict]:
        from campaign_orchestrator.generation.local import LocalModel

        if name in self.generators:
            return 400, {"error": {"message": f"The lora adapter '{name}' has already been loaded."}}
        if self.lora_base is None or not Path(path, "adapter_config.json").exists():
            return 400, {"error": {"message": f"cannot load a LoRA adapter from {path}"}}
        self.generators[name] = LocalModel.from_path(self.lora_base, path, batch_size=1)
        self.loaded[name] = path
        return 200, {"status": "ok"}

    def complete(self, req: dict) -> tuple[int, dict]:
        prompt, model = req["prompt"], req["model"]
        if model not in self.generators:
            return 404, {"error": {"message": f"The model `{model}` does not exist."}}
        if self.crash_marker in prompt:
            return 500, {"error": {"message": "engine crashed"}}
        gen = self.generators[model]
        with self.gen_lock:  # one generation at a time per server: the models are not thread-safe
            c = gen.generate([prompt], int(req.get("max_tokens", 16)))[0]
        return 200, {
            "id": "cmpl-test",
            "object": "text_completion",
            "model": model,
            "choices": [{"index": 0, "text": c.text, "finish_reason": c.finish_reason}],
            "usage": {"prompt_tokens": c.prompt_tokens, "completion_tokens": c.completion_tokens},
        }

    def __enter__(self) -> ModelServer:
        self.thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()


def make_zero_adapter(base_model: Path, out_dir: Path, r: int = 4) -> Path:
    """A freshly initialized LoRA adapter (B = 0): base + adapter answers exactly like the base."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(base_model))
    get_peft_model(model, LoraConfig(r=r, lora_alpha=2 * r, target_modules=["q_proj", "v_proj"])).save_pretrained(
        str(out_dir)
    )
    return out_dir


def heldout_rows(n: int) -> list[dict]:
    """The first ``n`` demo prompts (with references and short/long categories)."""
    from campaign_orchestrator.dataset.prompts import read_prompts

    return read_prompts([REPO_ROOT / "campaigns/data/demo/prompts-0001.jsonl"])[:n]


def write_latest(root: Path, campaign: str, stage: str, manifest: dict) -> None:
    """What the manifest IO manager would have stored for an upstream stage."""
    p = root / campaign / stage / "LATEST.json"
    p.parent.mkdir(parents=True, exist_ok=True)
    p.write_text(json.dumps(manifest))


def seed_upstream(root: Path, campaign: str, rows: list[dict], adapter_dir: Path, base_model: Path) -> dict:
    """Prompts and student_adapter manifests for ``campaign`` (the stages before evaluation)."""
    from campaign_orchestrator.content import dir_sha256, file_sha256
    from campaign_orchestrator.dataset.prompts import write_prompts

    d = root / "_seed" / campaign
    d.mkdir(parents=True, exist_ok=True)
    held = write_prompts(rows, d / "heldout.parquet")
    write_latest(
        root,
        campaign,
        "prompts",
        {"key": "seeded", "path": str(d), "heldout_path": str(held), "heldout_sha256": file_sha256(held)},
    )
    adapter = {
        "key": dir_sha256(adapter_dir)[:20],
        "path": str(adapter_dir),
        "adapter_path": str(adapter_dir),
        "base_model_path": str(base_model),
    }
    write_latest(root, campaign, "student_adapter", adapter)
    return adapter
