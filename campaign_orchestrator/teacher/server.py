"""The project's own teacher server: a local checkpoint behind the OpenAI-compatible completions API, with
vLLM's ``prompt_logprobs`` (issue 26: the teacher scores the student's samples from another process or host).

    python -m campaign_orchestrator.teacher serve --model @packaged/smollm2-135m-instruct --port 8000

Routes (Starlette on uvicorn, both installed with the Dagster webserver):

``POST /v1/chat/completions``
    ``messages`` rendered with the tokenizer's chat template, then answered as a completion (no logprobs): an
    API teacher with ``chat: true`` and a few-shot ``context`` (``campaigns/smollm2_api.yaml``).
``GET /v1/models``
    ``{"object": "list", "data": [{"id": <served name>, "object": "model", "max_model_len": ...}]}``.
``POST /v1/completions``
    ``prompt``: text (tokenized as vLLM does: the tokenizer's special tokens added, no chat template), token
    ids, or a list of either (one choice per prompt, in order). ``max_tokens`` may be 0 (score only: vLLM
    itself wants at least 1) or more (greedy, or sampled with ``temperature``/``top_p``/``seed``; ``logprobs:
    k`` for the generated tokens in the OpenAI completions shape). ``prompt_logprobs: k`` adds vLLM's field to
    each choice: one entry per prompt token, the first ``None`` (nothing predicts it), then ``{token_id:
    {"logprob", "rank", "decoded_token"}}`` holding the prompt token itself (``rank``: its 1-based rank in the
    whole vocabulary) and the top ``k`` tokens (``rank`` 1..k); JSON keys are the ids as strings, as vLLM sends
    them. ``return_token_ids: true`` adds ``prompt_token_ids`` (and ``token_ids``) to each choice. ``usage``
    counts prompt and generated tokens. Errors have vLLM's shape (``{"error": {"message", "type", "code"}}``):
    400 for a request it cannot answer (a prompt over the context, ``prompt_logprobs`` over ``max_logprobs``),
    404 for another model name, 401 without the API key (when one is required).

Prompt log-probabilities come from one forward pass per batch of prompts (length-sorted, left-padded, as
:meth:`campaign_orchestrator.generation.local.LocalModel.score` computes them: position ids from the attention
mask, so a padded row computes what it would alone); the model answers one request at a time (a lock), off the
event loop. The API key (``--api-key-env NAME``: the *name* of the variable holding it) is never logged.
Imports torch when a model loads: build the app lazily.
"""

from __future__ import annotations

import argparse
import asyncio
import hmac
import json
import os
import socket
import sys
import threading
import time
import uuid
from collections.abc import Sequence
from pathlib import Path

MAX_LOGPROBS = 20  # vLLM's default --max-logprobs
MAX_BATCH_TOKENS = 4096  # prompt positions per forward pass: every position's logits are kept (x vocabulary x 4 bytes)
LOGPROB_FLOOR = -9999.0  # JSON has no -inf; vLLM clamps the same way


class RequestError(ValueError):
    """A request the server cannot answer (HTTP 400), with a message for the client."""

    def __init__(self, message: str, status: int = 400):
        super().__init__(message)
        self.status = status


class TeacherServer:
    """Answers completion requests with one loaded :class:`~campaign_orchestrator.generation.local.LocalModel`
    (its model, tokenizer, device, batch size and context length)."""

    def __init__(
        self,
        generator,
        served_name: str,
        api_key: str | None = None,
        max_logprobs: int = MAX_LOGPROBS,
        max_batch_tokens: int = MAX_BATCH_TOKENS,
    ):
        self.gen = generator
        self.max_batch_tokens = max_batch_tokens
        self.served_name = served_name
        self._api_key = api_key or None
        self.max_logprobs = max_logprobs
        self.lock = threading.Lock()
        self._decoded: dict[int, str] = {}
        self._texts: dict[int, str] = {}
        self._bytes = None  # the tokenizer's tokens as bytes (campaign_orchestrator.dataset.xtok), built on first use
        self.stats = {"requests": 0, "prompts": 0, "prompt_tokens": 0, "completion_tokens": 0, "forward_passes": 0}

    def __repr__(self) -> str:  # never the key
        return f"TeacherServer({self.served_name!r}, auth={'on' if self._api_key else 'off'})"

    # ------------------------------------------------------------------ requests

    def authorized(self, header: str | None) -> bool:
        if self._api_key is None:
            return True
        return hmac.compare_digest((header or "").encode(), f"Bearer {self._api_key}".encode())

    def _prompts(self, prompt, add_special_tokens: bool) -> list[list[int]]:
        """The request's prompts as token ids: text, ids, or a list of either."""

        def is_ids(x) -> bool:
            return isinstance(x, list) and all(isinstance(t, int) and not isinstance(t, bool) for t in x)

        if isinstance(prompt, str) or is_ids(prompt) and prompt:
            items = [prompt]
        elif isinstance(prompt, list) and prompt and all(isinstance(p, str) or is_ids(p) for p in prompt):
            items = prompt
        else:
            raise RequestError("`prompt` must be a string, a list of token ids, or a non-empty list of either")
        vocab = len(self.gen.tok)
        out = []
        for p in items:
            ids = self.gen.tok(p, add_special_tokens=add_special_tokens)["input_ids"] if isinstance(p, str) else list(p)
            if not ids:
                raise RequestError("a prompt has no tokens")
            bad = [t for t in ids if not 0 <= t < max(vocab, self.gen.model.config.vocab_size)]
            if bad:
                raise RequestError(f"token id {bad[0]} is out of vocabulary (size {vocab})")
            out.append(ids)
        return out

    def _int(self, body: dict, name: str, default: int | None, low: int, high: int | None = None) -> int | None:
        value = body.get(name, default)
        if value is None:
            return None
        if isinstance(value, bool) or not isinstance(value, int) or value < low or (high is not None and value > high):
            span = f"{low}..{high}" if high is not None else f">= {low}"
            raise RequestError(f"`{name}` must be an integer {span}, got {value!r}")
        return value

    def complete(self, body: dict) -> dict:
        """The response body of ``POST /v1/completions`` (raises :class:`RequestError`)."""
        if body.get("model") not in (None, self.served_name):
            raise RequestError(f"The model `{body.get('model')}` does not exist.", status=404)
        if body.get("stream"):
            raise RequestError("`stream` is not supported by this server")
        if body.get("echo"):
            raise RequestError("`echo` is not supported by this server: use `prompt_logprobs`")
        if self._int(body, "n", 1, 1) != 1:
            raise RequestError("`n` > 1 is not supported by this server")
        max_tokens = self._int(body, "max_tokens", 16, 0)
        k_prompt = self._int(body, "prompt_logprobs", None, 0, self.max_logprobs)
        k_gen = self._int(body, "logprobs", None, 0, self.max_logprobs)
        temperature = float(body.get("temperature") if body.get("temperature") is not None else 1.0)
        top_p = float(body.get("top_p") if body.get("top_p") is not None else 1.0)
        seed = self._int(body, "seed", 0, 0) or 0
        prompts = self._prompts(body.get("prompt"), bool(body.get("add_special_tokens", True)))
        ctx = self.gen.context_length
        for ids in prompts:
            if ctx and len(ids) + max_tokens > ctx:
                raise RequestError(
                    f"This model's maximum context length is {ctx} tokens. However, you requested "
                    f"{len(ids) + max_tokens} tokens ({len(ids)} in the prompt, {max_tokens} in the "
                    f"completion). Please reduce the length of the prompt or completion."
                )
        with self.lock:
            scored = self.prompt_logprobs(prompts, k_prompt) if k_prompt is not None else [None] * len(prompts)
            generated = [
                self.generate(ids, max_tokens, temperature, top_p, seed, k_gen) if max_tokens else None
                for ids in prompts
            ]
        choices = []
        n_out = 0
        for i, (ids, plp, g) in enumerate(zip(prompts, scored, generated, strict=True)):
            toks, text, finish, lp = g or ([], "", "length", None)
            n_out += len(toks)
            choice = {
                "index": i,
                "text": text,
                "logprobs": lp,
                "finish_reason": finish,
                "stop_reason": None,
                "prompt_logprobs": plp,
            }
            if body.get("return_token_ids"):
                choice |= {"prompt_token_ids": ids, "token_ids": toks}
            choices.append(choice)
        n_prompt = sum(len(p) for p in prompts)
        self.stats["requests"] += 1
        self.stats["prompts"] += len(prompts)
        self.stats["prompt_tokens"] += n_prompt
        self.stats["completion_tokens"] += n_out
        return {
            "id": f"cmpl-{uuid.uuid4().hex}",
            "object": "text_completion",
            "created": int(time.time()),
            "model": self.served_name,
            "choices": choices,
            "usage": {"prompt_tokens": n_prompt, "completion_tokens": n_out, "total_tokens": n_prompt + n_out},
        }

    def chat(self, body: dict) -> dict:
        """The response body of ``POST /v1/chat/completions``: ``messages`` rendered with the tokenizer's chat
        template (generation prompt added), then answered as :meth:`complete` answers token ids (no logprobs)."""
        msgs = body.get("messages")
        if not isinstance(msgs, list) or not msgs or not all(isinstance(m, dict) and "role" in m for m in msgs):
            raise RequestError("`messages` must be a non-empty list of {role, content} objects")
        if body.get("logprobs"):
            raise RequestError("`logprobs` is not supported on /v1/chat/completions by this server")
        from campaign_orchestrator.dataset.formatting import FormatError, render_prompt_ids

        try:  # the rendering the local engine uses for a context-distillation teacher
            ids = render_prompt_ids(self.gen.tok, [{"role": m["role"], "content": m.get("content", "")} for m in msgs])
        except FormatError as e:
            raise RequestError(f"{e}: use /v1/completions") from None
        out = self.complete(
            {k: v for k, v in body.items() if k not in ("messages", "logprobs", "top_logprobs")} | {"prompt": ids}
        )
        ch = out["choices"][0]
        return {
            "id": out["id"].replace("cmpl-", "chatcmpl-"),
            "object": "chat.completion",
            "created": out["created"],
            "model": out["model"],
            "usage": out["usage"],
            "choices": [
                {
                    "index": 0,
                    "message": {"role": "assistant", "content": ch["text"]},
                    "logprobs": None,
                    "finish_reason": ch["finish_reason"],
                }
            ],
        }

    # ------------------------------------------------------------------ the model

    def _decode(self, tid: int) -> str:
        s = self._decoded.get(tid)
        if s is None:
            s = self._decoded[tid] = self.gen.tok.decode([tid])
        return s

    def _token_text(self, tid: int) -> str:
        """A generated token as the completions API's ``tokens`` and ``top_logprobs`` write it: its exact bytes as
        text, ``bytes:\\xNN...`` for a token that holds part of a character (xtok.token_string), a special
        token by its name; so a client with another tokenizer can align by bytes."""
        s = self._texts.get(tid)
        if s is None:
            from campaign_orchestrator.dataset.xtok import TokenizerBytes, token_string

            if self._bytes is None:
                self._bytes = TokenizerBytes.from_tokenizer(self.gen.tok)
            b = self._bytes.bytes_of(tid)
            s = self._texts[tid] = token_string(b) if b is not None else self._decode(tid)
        return s

    def _entry(self, tid: int, lp: float, rank: int) -> dict:
        return {"logprob": max(float(lp), LOGPROB_FLOOR), "rank": int(rank), "decoded_token": self._decode(tid)}

    def prompt_logprobs(self, prompts: Sequence[list[int]], k: int) -> list[list[dict | None]]:
        """vLLM's ``prompt_logprobs`` for each prompt: ``[None, {id: entry}, ...]``, one forward pass per batch of
        length-sorted prompts (at most ``batch_size`` rows and ``max_batch_tokens`` padded positions)."""
        import torch

        gen = self.gen
        out: list[list | None] = [None] * len(prompts)
        for idx in self._batches(prompts):
            width = max(len(prompts[i]) for i in idx)
            ids = torch.full((len(idx), width), gen.tok.pad_token_id, dtype=torch.long)
            mask = torch.zeros((len(idx), width), dtype=torch.long)
            for row, i in enumerate(idx):
                p = prompts[i]
                ids[row, width - len(p) :] = torch.tensor(p)
                mask[row, width - len(p) :] = 1
            pos = (mask.cumsum(-1) - 1).clamp(min=0)
            dev = gen.device
            with torch.no_grad():
                logits = gen.model(
                    input_ids=ids.to(dev), attention_mask=mask.to(dev), position_ids=pos.to(dev), use_cache=False
                ).logits
            self.stats["forward_passes"] += 1
            for row, i in enumerate(idx):
                p = prompts[i]
                if len(p) < 2:
                    out[i] = [None]
                    continue
                with torch.no_grad():  # position t predicts token t + 1
                    lp = torch.log_softmax(logits[row, width - len(p) : width - 1].float(), dim=-1)
                    tgt = torch.tensor(p[1:], device=lp.device)
                    own = lp.gather(-1, tgt[:, None])[:, 0]
                    rank = (lp > own[:, None]).sum(-1) + 1
                    tv, ti = lp.topk(min(k, lp.shape[-1]), dim=-1) if k else (None, None)
                own_l, rank_l = own.cpu().tolist(), rank.cpu().tolist()
                tv_l = tv.cpu().tolist() if k else [[]] * len(own_l)
                ti_l = ti.cpu().tolist() if k else [[]] * len(own_l)
                entries: list[dict | None] = [None]
                for t, tid in enumerate(p[1:]):
                    d = {str(tid): self._entry(tid, own_l[t], rank_l[t])}
                    for r, (a, v) in enumerate(zip(ti_l[t], tv_l[t], strict=True), start=1):
                        if str(a) not in d:
                            d[str(a)] = self._entry(a, v, r)
                    entries.append(d)
                out[i] = entries
            del logits
        return out  # type: ignore[return-value]

    def _batches(self, prompts: Sequence[list[int]]) -> list[list[int]]:
        order = sorted(range(len(prompts)), key=lambda i: len(prompts[i]))
        batches: list[list[int]] = []
        for i in order:  # sorted: the newest prompt is the batch's longest
            b = batches[-1] if batches else None
            if b and len(b) < self.gen.batch_size and (len(b) + 1) * len(prompts[i]) <= self.max_batch_tokens:
                b.append(i)
            else:
                batches.append([i])
        return batches

    def generate(
        self, ids: list[int], max_tokens: int, temperature: float, top_p: float, seed: int, k: int | None
    ) -> tuple[list[int], str, str, dict | None]:
        """(token ids, text, finish reason, OpenAI completions ``logprobs`` or None) for one prompt, decoding
        ``max_tokens`` tokens at most (stopping at the model's stop ids)."""
        import torch

        gen = self.gen
        dev = gen.device
        sample = temperature > 0
        kw = {
            "do_sample": sample,
            "max_new_tokens": max_tokens,
            "eos_token_id": gen.stop_ids,
            "pad_token_id": gen.tok.pad_token_id,
            "return_dict_in_generate": True,
            "output_logits": True,
        }
        if sample:
            kw |= {"temperature": temperature, "top_p": top_p}
        else:  # greedy: no sampling warpers from the checkpoint's generation config
            kw |= {"temperature": None, "top_p": None, "top_k": None}
        if sample:
            torch.manual_seed(seed)
        with torch.no_grad():
            o = gen.model.generate(
                input_ids=torch.tensor([ids], device=dev),
                attention_mask=torch.ones((1, len(ids)), dtype=torch.long, device=dev),
                **kw,
            )
        self.stats["forward_passes"] += len(o.logits)
        toks = o.sequences[0, len(ids) :].cpu().tolist()
        stopped = bool(toks) and toks[-1] in gen.stop_ids
        text = gen.tok.decode(toks[:-1] if stopped else toks, skip_special_tokens=True)
        lp = None
        if k is not None:
            tokens, token_lps, tops, offsets, at = [], [], [], [], 0
            for step, tid in enumerate(toks):
                dist = torch.log_softmax(o.logits[step][0].float(), dim=-1)
                s = self._token_text(tid)
                tokens.append(s)
                token_lps.append(max(float(dist[tid]), LOGPROB_FLOOR))
                offsets.append(at)
                at += len(s)
                if k:
                    tv, ti = dist.topk(min(k, dist.shape[-1]))
                    tops.append(
                        {
                            self._token_text(a): max(v, LOGPROB_FLOOR)
                            for a, v in zip(ti.tolist(), tv.tolist(), strict=True)
                        }
                    )
                else:
                    tops.append(None)
            lp = {"tokens": tokens, "token_logprobs": token_lps, "top_logprobs": tops, "text_offset": offsets}
        return toks, text, "stop" if stopped else "length", lp


def build_app(server: TeacherServer):
    """The Starlette app serving ``server``."""
    from starlette.applications import Starlette
    from starlette.requests import Request
    from starlette.responses import JSONResponse
    from starlette.routing import Route

    def error(status: int, message: str) -> JSONResponse:
        kind = {401: "AuthenticationError", 404: "NotFoundError"}.get(status, "BadRequestError")
        return JSONResponse(
            {"error": {"message": message, "type": kind, "param": None, "code": status}}, status_code=status
        )

    async def answer(request: Request, handler) -> JSONResponse:
        if not server.authorized(request.headers.get("authorization")):
            return error(401, "Incorrect API key provided.")
        try:
            body = json.loads(await request.body())
        except ValueError:
            return error(400, "the request body is not JSON")
        if not isinstance(body, dict):
            return error(400, "the request body must be a JSON object")
        try:
            return JSONResponse(await asyncio.to_thread(handler, body))
        except RequestError as e:
            return error(e.status, str(e))

    async def completions(request: Request) -> JSONResponse:
        return await answer(request, server.complete)

    async def chat_completions(request: Request) -> JSONResponse:
        return await answer(request, server.chat)

    async def models(request: Request) -> JSONResponse:
        if not server.authorized(request.headers.get("authorization")):
            return error(401, "Incorrect API key provided.")
        return JSONResponse(
            {
                "object": "list",
                "data": [
                    {
                        "id": server.served_name,
                        "object": "model",
                        "created": 0,
                        "owned_by": "campaign-orchestrator",
                        "max_model_len": server.gen.context_length,
                    }
                ],
            }
        )

    async def health(request: Request) -> JSONResponse:
        return JSONResponse({"ok": True, **server.stats})

    return Starlette(
        routes=[
            Route("/v1/completions", completions, methods=["POST"]),
            Route("/v1/chat/completions", chat_completions, methods=["POST"]),
            Route("/v1/models", models, methods=["GET"]),
            Route("/health", health, methods=["GET"]),
        ]
    )


def serve_main(argv: list[str] | None = None) -> int:
    """``python -m campaign_orchestrator.teacher serve``: load the model, then serve until interrupted."""
    ap = argparse.ArgumentParser(
        prog="python -m campaign_orchestrator.teacher serve",
        description="Serve a local teacher over the OpenAI-compatible completions API with vLLM's prompt_logprobs.",
    )
    ap.add_argument(
        "--model",
        required=True,
        help="a checkpoint directory or model reference (@packaged/..., "
        "@demo/..., .gguf), as a campaign's teacher.model",
    )
    ap.add_argument("--served-name", help="the name clients send as `model` (default: --model as given)")
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--port", type=int, default=8000, help="0 picks a free port (see --port-file)")
    ap.add_argument("--port-file", help="write the bound port here once the server accepts connections")
    ap.add_argument("--artifacts", default="artifacts", help="artifact root (model references resolve under it)")
    ap.add_argument("--compute-dtype", default="auto", choices=["auto", "bfloat16", "float16", "float32"])
    ap.add_argument("--batch-size", type=int, default=16, help="prompts per forward pass")
    ap.add_argument("--max-logprobs", type=int, default=MAX_LOGPROBS, help="largest prompt_logprobs / logprobs k")
    ap.add_argument(
        "--api-key-env",
        help="name of an environment variable holding the key clients must send "
        "(Authorization: Bearer); never the key itself",
    )
    a = ap.parse_args(argv)

    from campaign_orchestrator import models

    api_key = None
    if a.api_key_env:
        api_key = os.environ.get(a.api_key_env)
        if not api_key:
            print(
                f"error: --api-key-env names {a.api_key_env!r}, but that environment variable is not set",
                file=sys.stderr,
            )
            return 1
    try:
        model_dir = models.resolve(a.model, Path(a.artifacts).resolve(), Path.cwd())
    except models.ModelNotFound as e:
        print(f"error: --model: {e}", file=sys.stderr)
        return 1
    import uvicorn

    from campaign_orchestrator.generation.local import LocalModel

    gen = LocalModel.from_path(model_dir, compute_dtype=a.compute_dtype, batch_size=a.batch_size)
    server = TeacherServer(gen, a.served_name or a.model, api_key=api_key, max_logprobs=a.max_logprobs)
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((a.host, a.port))
    uv = uvicorn.Server(uvicorn.Config(build_app(server), log_level="warning", access_log=False))

    def announce() -> None:
        while not uv.started:
            time.sleep(0.01)
        port = sock.getsockname()[1]
        if a.port_file:
            tmp = Path(a.port_file + ".tmp")
            tmp.write_text(str(port))
            tmp.replace(a.port_file)
        precision = getattr(gen.precision, "dtype", None)
        print(
            f"serving {server.served_name!r} ({model_dir}, {precision or 'model dtype'}) at http://{a.host}:{port}/v1",
            file=sys.stderr,
            flush=True,
        )

    threading.Thread(target=announce, daemon=True).start()
    uv.run(sockets=[sock])
    return 0
