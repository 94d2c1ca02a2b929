"""The serving path: score what an OpenAI-compatible server answers (e.g. ``vllm serve BASE
--enable-lora --lora-modules NAME=ADAPTER``), with the same items as the adapter on disk.

:class:`OpenAIEndpoint` is a thin ``generate(prompts, max_new_tokens) -> completions`` callable
over httpx: greedy ``/v1/completions`` requests, at most ``max_concurrency`` in flight, every
failure (timeout, connection error, HTTP error, malformed answer) recorded on its item as
``error`` so the gate counts it as a serving error, never as a wrong answer. No retries: an
evaluation measures the endpoint as it is. Before a score is credited to a candidate,
:meth:`OpenAIEndpoint.verify_adapter` checks that the served model is that candidate's adapter (its
``/v1/models`` root has the same content fingerprint). The project's generation client
(``campaign_orchestrator/teacher/``) has the same shape and can replace it.
"""

from __future__ import annotations

import asyncio
import os
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import httpx


class AdapterNotVerified(RuntimeError):
    """The server's model cannot be shown to be the candidate's adapter: no score is credited to it."""


@dataclass
class EndpointCompletion:
    text: str
    finish_reason: str  # "stop", "length" or "error"
    latency_s: float
    error: str | None = None


class OpenAIEndpoint:
    def __init__(
        self,
        base_url: str,
        model: str,
        *,
        api_key: str | None = None,
        api_key_env: str | None = None,
        max_concurrency: int = 8,
        timeout_s: float = 60.0,
    ):
        if api_key is None and api_key_env:
            api_key = os.environ.get(api_key_env)
            if not api_key:
                raise ValueError(f"environment variable {api_key_env} (the endpoint's API key) is not set")
        self.base_url = base_url.rstrip("/")
        self.model = model
        self._headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self.max_concurrency = max_concurrency
        self.timeout_s = timeout_s

    def __repr__(self) -> str:  # never the key
        return f"OpenAIEndpoint({self.base_url!r}, model={self.model!r})"

    def __call__(self, prompts: Sequence[str], max_new_tokens: int) -> list[EndpointCompletion]:
        return self.generate(prompts, max_new_tokens)

    def generate(self, prompts: Sequence[str], max_new_tokens: int) -> list[EndpointCompletion]:
        """One completion per prompt, in order (runs its own event loop, in a thread if one is running)."""
        coro_fn = lambda: self._generate(list(prompts), max_new_tokens)  # noqa: E731
        try:
            asyncio.get_running_loop()
        except RuntimeError:
            return asyncio.run(coro_fn())
        box: dict = {}
        t = threading.Thread(target=lambda: box.setdefault("out", asyncio.run(coro_fn())))
        t.start()
        t.join()
        return box["out"]

    async def _generate(self, prompts: list[str], max_new_tokens: int) -> list[EndpointCompletion]:
        sem = asyncio.Semaphore(self.max_concurrency)
        limits = httpx.Limits(max_connections=self.max_concurrency, max_keepalive_connections=self.max_concurrency)
        async with httpx.AsyncClient(timeout=self.timeout_s, limits=limits, headers=self._headers) as client:

            async def one(prompt: str) -> EndpointCompletion:
                async with sem:
                    return await self._complete(client, prompt, max_new_tokens)

            return list(await asyncio.gather(*(one(p) for p in prompts)))

    async def _complete(self, client: httpx.AsyncClient, prompt: str, max_new_tokens: int) -> EndpointCompletion:
        body = {"model": self.model, "prompt": prompt, "max_tokens": max_new_tokens, "temperature": 0.0, "n": 1}
        t0 = time.perf_counter()
        try:
            r = await client.post(f"{self.base_url}/completions", json=body)
        except httpx.TimeoutException:
            return EndpointCompletion("", "error", time.perf_counter() - t0, f"timeout after {self.timeout_s:g} s")
        except httpx.HTTPError as e:
            return EndpointCompletion("", "error", time.perf_counter() - t0, f"{type(e).__name__}: {e}"[:300])
        latency = time.perf_counter() - t0
        if r.status_code >= 400:
            return EndpointCompletion("", "error", latency, f"HTTP {r.status_code}: {r.text[:200]}")
        try:
            choice = r.json()["choices"][0]
            return EndpointCompletion(choice["text"], choice.get("finish_reason") or "stop", latency)
        except (ValueError, KeyError, IndexError, TypeError):
            return EndpointCompletion("", "error", latency, f"malformed completion response: {r.text[:200]}")

    def served_models(self) -> list[dict]:
        """``GET /v1/models``: what the server serves (vLLM lists a LoRA module with its ``root``, the
        adapter directory it was loaded from, and its ``parent``, the base model)."""
        r = httpx.get(f"{self.base_url}/models", headers=self._headers, timeout=self.timeout_s)
        if r.status_code >= 400:
            raise AdapterNotVerified(
                f"{self.base_url}/models answered HTTP {r.status_code} {r.text[:200]}: cannot "
                "check which adapter the server serves"
            )
        try:
            return list(r.json()["data"])
        except (ValueError, KeyError, TypeError):
            raise AdapterNotVerified(f"{self.base_url}/models answered no model list: {r.text[:200]}") from None

    def verify_adapter(self, name: str, adapter_dir: str | Path) -> dict:
        """Check that the served model ``name`` is the LoRA adapter in ``adapter_dir``, byte for byte:
        its ``root`` (from ``/v1/models``) must be a directory here whose files have the same content
        fingerprint. Returns what was checked; raises :class:`AdapterNotVerified` saying why not."""
        from campaign_orchestrator.content import model_fingerprint

        entry = next((m for m in self.served_models() if m.get("id") == name), None)
        if entry is None:
            raise AdapterNotVerified(f"{self.base_url} does not serve a model named {name!r}")
        root = entry.get("root")
        if not root or root == entry.get("parent") or not Path(root).is_dir():
            raise AdapterNotVerified(
                f"cannot verify that {self.base_url} serves this candidate as {name!r}: its /v1/models entry gives "
                + (f"root {root!r}, not an adapter directory visible here" if root else "no adapter root")
                + "; set evaluation.endpoint.load_adapter: true (the candidate is loaded onto the server), or serve "
                "the adapter from a path this machine sees too"
            )
        want, got = model_fingerprint(adapter_dir), model_fingerprint(root)
        if want != got:
            raise AdapterNotVerified(
                f"{self.base_url} serves {name!r} from {root} (content {got[:12]}), not the "
                f"candidate's adapter {adapter_dir} (content {want[:12]}): its score would be "
                "credited to another adapter; serve this candidate or set load_adapter: true"
            )
        return {"name": name, "root": str(root), "fingerprint": want, "parent": entry.get("parent")}

    def load_adapter(self, name: str, path: str) -> None:
        """Ask the server to serve the LoRA adapter at ``path`` as ``name`` (vLLM's runtime LoRA
        loading, ``POST /v1/load_lora_adapter``). A name the server already has is accepted."""
        r = httpx.post(
            f"{self.base_url}/load_lora_adapter",
            json={"lora_name": name, "lora_path": path},
            headers=self._headers,
            timeout=self.timeout_s,
        )
        if r.status_code >= 400 and "already" not in r.text.lower():
            raise RuntimeError(
                f"{self.base_url}/load_lora_adapter refused adapter {name!r} at {path}: "
                f"HTTP {r.status_code} {r.text[:300]} (vLLM needs VLLM_ALLOW_RUNTIME_LORA_UPDATING=True "
                "and the path visible to the server)"
            )
