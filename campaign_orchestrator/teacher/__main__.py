"""``python -m campaign_orchestrator.teacher``: teacher generation outside Dagster, with the same cache.

    python -m campaign_orchestrator.teacher --prompts 'data/*.jsonl' --out gens.parquet \\
        --teacher '{backend: openai, model: my-model, base_url: "http://localhost:8000/v1", max_concurrency: 64}'

    python -m campaign_orchestrator.teacher serve --model @packaged/smollm2-135m-instruct --port 8000

``serve`` runs the project's own teacher server (:mod:`campaign_orchestrator.teacher.server`): the model behind
the OpenAI-compatible ``/v1/completions`` with vLLM's ``prompt_logprobs``, for on-policy distillation's teacher
scoring from another process or host (``serve --help`` lists its options).

``--teacher`` is a YAML file or an inline YAML mapping with the fields of a campaign's
``teacher:`` section. The cache defaults to ``artifacts/cache`` (``--cache DIR`` or
``--cache s3://bucket/prefix``); killing the command and running it again generates only what
is missing. Prints the run's statistics as JSON. Exit codes: 0 done, 1 bad input, 2 the
teacher failed (finished generations are kept in the cache).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import yaml

EXIT_OK, EXIT_INPUT, EXIT_FAILED = 0, 1, 2


def _teacher_spec(text: str):
    from pydantic import ValidationError

    from campaigns.spec import UNPRICED, TeacherSpec

    p = Path(text)
    raw = (
        yaml.safe_load(p.read_text(encoding="utf-8"))
        if p.suffix in (".yaml", ".yml", ".json") and p.exists()
        else yaml.safe_load(text)
    )
    if not isinstance(raw, dict):
        raise ValueError(f"--teacher: expected a YAML mapping or file with the campaign's teacher fields, got {text!r}")
    # this tool records no cost: a teacher given without its price field is unpriced here (a campaign must say)
    raw.setdefault("price" if raw.get("backend") == "openai" else "hardware", UNPRICED)
    try:
        return TeacherSpec(**raw)
    except ValidationError as e:
        lines = [
            f"  teacher.{'.'.join(map(str, err['loc']))}: {err['msg']}" if err["loc"] else f"  teacher: {err['msg']}"
            for err in e.errors()
        ]
        raise ValueError("--teacher is not a valid teacher spec:\n" + "\n".join(lines)) from None


def _model_path(spec, artifacts: Path) -> Path | None:
    from campaign_orchestrator import models

    if spec.backend == "openai":
        return None
    if spec.backend == "vllm" and models.is_hub_id(spec.model):
        return None  # a hub id vLLM downloads itself
    try:
        return models.resolve(spec.model, artifacts, revision=spec.revision)
    except models.ModelNotFound as e:
        raise ValueError(f"teacher.model: {e}") from None


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if args[:1] == ["serve"]:
        from campaign_orchestrator.teacher.server import serve_main

        return serve_main(args[1:])
    ap = argparse.ArgumentParser(prog="python -m campaign_orchestrator.teacher", description=__doc__.split("\n\n")[0])
    ap.add_argument("--prompts", required=True, help="JSONL file or glob ({id, prompt} per line)")
    ap.add_argument("--teacher", required=True, help="YAML file or inline YAML mapping: the campaign's teacher fields")
    ap.add_argument("--out", required=True, help="Parquet file for the generation rows")
    ap.add_argument("--artifacts", default="artifacts", help="artifact root (demo models, default cache)")
    ap.add_argument("--cache", help="cache location: a directory or s3://bucket/prefix (default: ARTIFACTS/cache)")
    ap.add_argument("--s3-endpoint-url", help="S3-compatible endpoint for an s3:// cache")
    ap.add_argument("--shard-rows", type=int, default=256, help="rows per cache shard")
    ap.add_argument("--quiet", action="store_true", help="no progress bar")
    a = ap.parse_args(args)

    from campaign_orchestrator.dataset.prompts import PromptSourceError, read_prompts, source_files
    from campaign_orchestrator.generation.backends import BackendError, make_backend, read_api_key, spec_identity
    from campaign_orchestrator.generation.blobstore import open_store
    from campaign_orchestrator.generation.cache import GenerationCache
    from campaign_orchestrator.generation.openai_client import EndpointError
    from campaign_orchestrator.generation.requests import Sampling, namespace
    from campaign_orchestrator.generation.rows import write_generations
    from campaign_orchestrator.generation.runner import GenerationError, run_generation

    artifacts = Path(a.artifacts).resolve()
    try:
        spec = _teacher_spec(a.teacher)
        rows = read_prompts(source_files(a.prompts, Path.cwd()))
        model_path = _model_path(spec, artifacts)
        api_key = read_api_key(spec.api_key_env) if spec.backend == "openai" else None
    except (PromptSourceError, ValueError, BackendError, OSError, yaml.YAMLError) as e:
        print(f"error: {e}", file=sys.stderr)
        return EXIT_INPUT
    sampling = Sampling.from_spec(spec.sampling)
    identity = spec_identity(spec, model_path)
    store = open_store(a.cache or artifacts / "cache", endpoint_url=a.s3_endpoint_url)
    cache = GenerationCache(
        store, namespace(identity, sampling), artifacts / "cache" / "spool", shard_rows=a.shard_rows
    )
    progress = None
    bar = None
    if not a.quiet:
        from tqdm import tqdm

        bar = tqdm(total=len(rows) * sampling.n, unit="samples", file=sys.stderr, mininterval=0.5)
        progress = bar.update
    try:
        backend = make_backend(spec, model_path, api_key=api_key)
        res = run_generation(
            rows,
            backend,
            sampling,
            cache,
            chat=spec.chat,
            context=[m.model_dump() for m in spec.context],
            context_categories=spec.context_categories,
            progress=progress,
            log=lambda m: print(m, file=sys.stderr, flush=True),
        )
    except (EndpointError, BackendError, GenerationError) as e:
        print(f"error: {e}", file=sys.stderr)
        return EXIT_FAILED
    finally:
        if bar is not None:
            bar.close()
    write_generations(res.rows, a.out)
    print(json.dumps(res.stats.as_dict() | {"out": str(a.out), "cache": store.url}, indent=2))
    return EXIT_OK


if __name__ == "__main__":
    sys.exit(main())
