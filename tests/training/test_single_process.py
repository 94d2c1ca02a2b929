"""The trainer in one process (world of one, gloo): resume, guards, distillation, exports, sizes.

Each run goes through ``training.recipes.run`` in this process, exactly as ``python -m training``
does without torchrun; torchrun-launched multi-process runs are in test_training_distributed.py.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests.support.hosts import DTYPES
from tests.support.train_support import make_job, write_cipher_dataset

pytestmark = pytest.mark.stage  # real training runs on the demo models

SMALL = {"lora": {"r": 4, "alpha": 8, "dropout": 0.1, "target_modules": ["q_proj", "v_proj", "down_proj"]}}
TORCH = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def small(dtype: str) -> dict:
    """SMALL on the demo's 4-bit student computing in ``dtype`` (named: `auto` is fp32 on AVX2 hosts, bf16 on
    AVX512-BF16 ones, and these tests compare against references computed in a named dtype)."""
    return SMALL | {"quantization": {"load_in_4bit": True, "compute_dtype": dtype}}


@pytest.fixture(scope="module")
def cipher_ds(tmp_path_factory, demo_models):
    return write_cipher_dataset(tmp_path_factory.mktemp("ds") / "cipher", demo_models["student"], 96, seed=5)


def _adapter(out: Path) -> dict:
    from safetensors.torch import load_file

    return load_file(str(out / "adapter" / "adapter_model.safetensors"))


def test_interrupted_run_resumes_to_the_same_adapter(run_job, tmp_path, demo_models, cipher_ds, monkeypatch):
    """A run that dies after a checkpoint resumes there (adapter, optimizer, LR, RNG, data position)
    and ends with the adapter of an uninterrupted run; the non-finite guard stops before the update."""
    from training.recipes import LoraFinetuneRecipe, TrainingError

    kw = dict(
        student=SMALL,
        max_steps=8,
        micro_batch_size=8,
        eval_rows=16,
        warmup_steps=2,
        checkpoint={"every_steps": 3, "every_minutes": None, "keep_last": 5},
    )
    straight = run_job(make_job(tmp_path / "a", demo_models["student"], cipher_ds, **kw), "a")
    assert straight["resumed_from_step"] is None and straight["trained_steps"] == 8

    real_forward = LoraFinetuneRecipe._forward
    calls = {"n": 0}

    def poisoned(self, batch):  # the 7th training forward yields NaN logits
        logits = real_forward(self, batch)
        if self.model.training:
            calls["n"] += 1
            if calls["n"] == 7:
                return logits * float("nan")
        return logits

    monkeypatch.setattr(LoraFinetuneRecipe, "_forward", poisoned)
    out_b = tmp_path / "b"
    with pytest.raises(TrainingError, match=r"step 7: non-finite loss nan.*Last good checkpoint: .*step-00000006"):
        run_job(make_job(out_b, demo_models["student"], cipher_ds, **kw), "b1")
    monkeypatch.setattr(LoraFinetuneRecipe, "_forward", real_forward)
    done = sorted(d.name for d in (out_b / "checkpoints").glob("step-*") if (d / "_SUCCESS").exists())
    assert done == ["step-00000003", "step-00000006"]  # the bad step wrote nothing
    assert not (out_b / "adapter").exists()

    resumed = run_job(make_job(out_b, demo_models["student"], cipher_ds, **kw), "b2")
    assert resumed["resumed_from_step"] == 6 and resumed["trained_steps"] == 8
    assert resumed["eval_loss_before"] == pytest.approx(straight["eval_loss_before"])
    a, b = _adapter(tmp_path / "a"), _adapter(out_b)
    for k in a:
        torch.testing.assert_close(b[k], a[k], rtol=0, atol=0, msg=k)
    assert resumed["eval_loss"] == pytest.approx(straight["eval_loss"], rel=1e-6)


def test_all_masked_steps_are_counted_and_skipped(run_job, tmp_path, demo_models):
    import pyarrow.parquet as pq

    ds = write_cipher_dataset(tmp_path / "ds", demo_models["student"], 6, seed=1, masked_rows=6)
    s = run_job(
        make_job(
            tmp_path / "out",
            demo_models["student"],
            ds,
            student=SMALL,
            max_steps=12,
            micro_batch_size=1,
            eval_rows=0,
            checkpoint={"every_steps": None},
        )
    )
    assert s["skipped_steps"] == 6 and s["trained_steps"] == 6
    metrics = pq.read_table(tmp_path / "out" / "metrics.parquet").to_pylist()
    assert len(metrics) == 6 and all(m["loss"] > 0 and m["loss_tokens"] > 0 for m in metrics)


def test_adapter_only_checkpoint_is_a_small_share_of_the_base(run_job, tmp_path, demo_models):
    """Checkpoints hold the adapter and its optimizer state, never the base. The demo student is so
    small (hidden 64) that any adapter is a large share of it (~40% with r=16), so the bound is checked
    on a base built from a config (hidden 1024, 2 layers, bf16 on disk) with LoRA r=4 on every linear:
    r / hidden is then what r=16 is on a 7B Llama (hidden 4096), the proportion that matters."""
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    tok = AutoTokenizer.from_pretrained(str(demo_models["student"]))
    cfg = LlamaConfig(
        vocab_size=len(tok),
        hidden_size=1024,
        intermediate_size=2816,
        num_hidden_layers=2,
        num_attention_heads=8,
        num_key_value_heads=8,
        max_position_embeddings=64,
        tie_word_embeddings=True,
        pad_token_id=tok.pad_token_id,
        bos_token_id=tok.bos_token_id,
        eos_token_id=tok.eos_token_id,
    )
    torch.manual_seed(0)
    base = tmp_path / "base"
    LlamaForCausalLM(cfg).to(torch.bfloat16).save_pretrained(str(base))
    tok.save_pretrained(str(base))
    ds = write_cipher_dataset(tmp_path / "ds", base, 8, seed=2)
    lora = {
        "lora": {
            "r": 4,
            "alpha": 8,
            "dropout": 0.0,
            "target_modules": ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"],
        }
    }
    s = run_job(
        make_job(
            tmp_path / "out",
            base,
            ds,
            student=lora,
            max_steps=2,
            micro_batch_size=4,
            eval_rows=0,
            checkpoint={"every_steps": 1},
        )
    )
    ckpt = tmp_path / "out" / "checkpoints" / "step-00000002"
    from safetensors import safe_open

    with safe_open(str(ckpt / "adapter_model.safetensors"), "pt") as f:
        assert f.keys() and all(".lora_A." in k or ".lora_B." in k for k in f.keys())
    assert s["base_model_bytes"] > 20e6
    share = s["checkpoint_bytes"] / s["base_model_bytes"]
    assert share <= 0.05, f"checkpoint is {share:.1%} of the base"
    assert s["adapter_bytes"] / s["base_model_bytes"] <= 0.02


@pytest.mark.parametrize("dtype", DTYPES)
def test_merged_export_matches_the_adapter(run_job, tmp_path, demo_models, cipher_ds, dtype):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    s = run_job(
        make_job(
            tmp_path / "out",
            demo_models["student"],
            cipher_ds,
            student=small(dtype),
            max_steps=3,
            micro_batch_size=8,
            eval_rows=0,
            export_merged=True,
            checkpoint={"every_steps": None},
        )
    )
    merged = AutoModelForCausalLM.from_pretrained(s["merged_dir"], dtype=torch.float32).eval()
    base = AutoModelForCausalLM.from_pretrained(str(demo_models["student"]), dtype=torch.float32)
    peft = PeftModel.from_pretrained(base, s["adapter_dir"]).eval()
    x = torch.tensor([[1, 10, 11, 12, 13, 14, 15]])
    with torch.no_grad():
        m, p = merged(input_ids=x).logits, peft(input_ids=x).logits
        with peft.disable_adapter():
            b = peft(input_ids=x).logits
    # The merged weights are stored in the compute dtype: equal up to its rounding, unlike the base.
    assert s["compute_dtype"] == dtype
    assert float((m - p).norm() / p.norm()) < (1e-2 if dtype == "bfloat16" else 1e-4)
    assert float((b - p).norm() / p.norm()) > 5 * float((m - p).norm() / p.norm())
    assert (Path(s["merged_dir"]) / "tokenizer.json").exists()


def test_logit_distillation_trains_and_refuses_a_foreign_tokenizer(run_job, tmp_path, demo_models):
    from tests.support.train_support import add_teacher_topk
    from training.recipes import TrainingError

    ds = add_teacher_topk(
        write_cipher_dataset(tmp_path / "ds", demo_models["student"], 48, seed=4), demo_models["teacher"], k=4
    )
    kd = {"loss": "logits", "kl_weight": 0.7}
    job = make_job(
        tmp_path / "out",
        demo_models["student"],
        ds,
        student=SMALL,
        max_steps=20,
        micro_batch_size=8,
        learning_rate=1e-2,
        eval_rows=16,
        distillation=kd,
        checkpoint={"every_steps": None},
    )
    s = run_job(job.model_copy(update={"teacher_tokenizer_path": str(demo_models["teacher"])}), "kd")
    import pyarrow.parquet as pq

    m = pq.read_table(tmp_path / "out" / "metrics.parquet").to_pylist()
    assert s["loss"] == "logits" and len(m) == 20
    assert all(r["kl_loss"] is not None and r["kl_loss"] >= 0 for r in m)
    kl = [r["kl_loss"] for r in m]
    assert sum(kl[-4:]) / 4 < 0.6 * sum(kl[:2]) / 2, kl  # the student moves toward the teacher's distributions
    assert m[0]["loss"] == pytest.approx(0.3 * m[0]["ce_loss"] + 0.7 * m[0]["kl_loss"])

    # a teacher with another vocabulary is refused before any model is loaded
    from transformers import AutoTokenizer

    other = AutoTokenizer.from_pretrained(str(demo_models["teacher"]))
    other.add_tokens(["<tool>"])
    other.save_pretrained(str(tmp_path / "other_tok"))
    bad = make_job(
        tmp_path / "bad", demo_models["student"], ds, student=SMALL, max_steps=2, micro_batch_size=8, distillation=kd
    ).model_copy(update={"teacher_tokenizer_path": str(tmp_path / "other_tok")})
    n = len(other)
    with pytest.raises(TrainingError, match=rf"shares the student.s tokenizer.*{n} tokens.*{n - 1} tokens.*<tool>"):
        run_job(bad, "bad")
    assert not (tmp_path / "bad" / "checkpoints").exists()
    # and a dataset without the teacher's top-k columns is refused with the column names
    plain = write_cipher_dataset(tmp_path / "plain", demo_models["student"], 16)
    nocols = make_job(
        tmp_path / "nocols",
        demo_models["student"],
        plain,
        student=SMALL,
        max_steps=2,
        micro_batch_size=8,
        distillation=kd,
    ).model_copy(update={"teacher_tokenizer_path": str(demo_models["teacher"])})
    with pytest.raises(TrainingError, match="teacher_topk_ids"):
        run_job(nocols, "nocols")


def test_fresh_disk_resumes_from_the_s3_mirror(run_job, tmp_path, demo_models, cipher_ds, s3):
    """Rank 0 mirrors each complete checkpoint to S3 (marker last); a start on an empty disk fetches the
    newest one and resumes from it."""
    import shutil

    kw = dict(
        student=SMALL,
        max_steps=4,
        micro_batch_size=8,
        eval_rows=0,
        checkpoint={"every_steps": 2, "every_minutes": None, "keep_last": 1},
    )
    uri = "s3://ckpts/demo/student_adapter/k1"
    job = make_job(tmp_path / "node", demo_models["student"], cipher_ds, **kw).model_copy(
        update={"checkpoint_uri": uri}
    )
    first = run_job(job, "first")
    keys = sorted(o["Key"] for o in s3.list_objects_v2(Bucket="ckpts")["Contents"])
    assert "demo/student_adapter/k1/step-00000004/_SUCCESS" in keys
    assert not any("step-00000002" in k for k in keys)  # keep_last 1 applies remotely too
    before = (tmp_path / "node" / "adapter" / "adapter_model.safetensors").read_bytes()
    shutil.rmtree(tmp_path / "node")  # the pod is rescheduled onto a fresh machine
    again = run_job(job, "again")
    assert again["resumed_from_step"] == 4 and first["resumed_from_step"] is None
    assert (tmp_path / "node" / "adapter" / "adapter_model.safetensors").read_bytes() == before


def test_sigterm_and_time_based_checkpoints(run_job, tmp_path, demo_models, cipher_ds, monkeypatch):
    """SIGTERM (preemption) checkpoints the state before the next step and stops with a clear error; a
    relaunch continues from there. every_minutes writes checkpoints by the clock, independent of steps."""
    import signal

    from training.recipes import LoraFinetuneRecipe, TrainingError

    kw = dict(student=SMALL, max_steps=6, micro_batch_size=8, eval_rows=0)
    real_prepare = LoraFinetuneRecipe.prepare

    def prepare(self, step, control=()):
        if step == 3:  # the signal arrives while the 4th step runs: it completes, then the state is saved
            self._on_sigterm(signal.SIGTERM, None)  # what the handler does when the signal arrives
        return real_prepare(self, step, control)

    monkeypatch.setattr(LoraFinetuneRecipe, "prepare", prepare)
    job = make_job(
        tmp_path / "pre",
        demo_models["student"],
        cipher_ds,
        checkpoint={"every_steps": None, "every_minutes": None},
        **kw,
    )
    with pytest.raises(TrainingError, match="stopped by SIGTERM before step 5; checkpoint .*step-00000004"):
        run_job(job, "pre")
    monkeypatch.setattr(LoraFinetuneRecipe, "prepare", real_prepare)
    assert (tmp_path / "pre" / "checkpoints" / "step-00000004" / "_SUCCESS").exists()
    assert run_job(job, "pre2")["resumed_from_step"] == 4

    clock = make_job(
        tmp_path / "clock",
        demo_models["student"],
        cipher_ds,
        checkpoint={"every_steps": None, "every_minutes": 1e-6, "keep_last": 10},
        **kw,
    )
    run_job(clock, "clock")
    steps = sorted(d.name for d in (tmp_path / "clock" / "checkpoints").glob("step-*"))
    assert len(steps) >= 5, steps  # one before (almost) every step, plus the final one


def _base_4bit(base: Path, dtype: str):
    """The demo base in 4-bit NF4 computing in ``dtype``, in eval mode: what an untrained LoRA computes."""
    from transformers import AutoModelForCausalLM, BitsAndBytesConfig

    q = BitsAndBytesConfig(
        load_in_4bit=True,
        bnb_4bit_quant_type="nf4",
        bnb_4bit_compute_dtype=TORCH[dtype],
        bnb_4bit_quant_storage=TORCH[dtype],
    )
    return AutoModelForCausalLM.from_pretrained(str(base), dtype=TORCH[dtype], quantization_config=q).eval()


def _base_loss(base: Path, ds: Path, rows: int, dtype: str) -> float:
    """Mean token cross-entropy of the 4-bit base computing in ``dtype`` (what an untrained LoRA computes) on
    ``rows`` rows of ``ds``."""
    from training import data as tdata
    from training import losses

    model = _base_4bit(base, dtype)
    data = tdata.load_rows(ds)
    total = n = 0.0
    with torch.no_grad():
        for i in range(0, rows, 8):
            b = tdata.collate(data, list(range(i, min(i + 8, rows))), model.config.pad_token_id or 0)
            s, k = losses.cross_entropy_sum(
                model(**{k: v for k, v in b.items() if k not in tdata.NON_MODEL_KEYS}).logits, b["labels"]
            )
            total, n = total + float(s), n + k
    return total / n


@pytest.mark.parametrize("dtype", DTYPES)
def test_eval_loss_is_measured_on_the_validation_split(run_job, tmp_path, demo_models, cipher_ds, dtype):
    """With a validation split the eval loss is its loss (not the training rows'); without one the trainer
    says it fell back to training rows; a dataset that records no tokenizer is refused before training."""
    from training.recipes import TrainingError

    val = write_cipher_dataset(tmp_path / "val", demo_models["student"], 16, seed=11, long_every=2)
    kw = dict(student=small(dtype), max_steps=2, micro_batch_size=8, eval_rows=64)
    job = make_job(tmp_path / "v", demo_models["student"], cipher_ds, **kw).model_copy(
        update={"validation_path": str(val)}
    )
    s = run_job(job, "v")
    assert (s["eval_source"], s["eval_rows"]) == ("validation", 16)
    on_val = _base_loss(demo_models["student"], val, 16, dtype)
    on_train = _base_loss(demo_models["student"], cipher_ds, 16, dtype)
    assert abs(on_val - on_train) > 0.05, (on_val, on_train)  # the two sets are told apart
    assert s["compute_dtype"] == dtype
    rel = 2e-2 if dtype == "bfloat16" else 1e-3  # the trainer's batches against these: bf16 rounds per batch
    assert s["eval_loss_before"] == pytest.approx(on_val, rel=rel), (s["eval_loss_before"], on_val, on_train)
    s = run_job(
        make_job(tmp_path / "t", demo_models["student"], cipher_ds, **kw).model_copy(
            update={"validation_path": str(tmp_path / "empty")}
        ),
        "t",
    )
    assert s["eval_source"].startswith("train") and s["eval_rows"] == 64

    import pyarrow.parquet as pq

    f = next(cipher_ds.glob("*.parquet"))
    t = pq.read_table(f)
    anon = tmp_path / "anon"
    anon.mkdir()
    pq.write_table(
        t.replace_schema_metadata({k: v for k, v in t.schema.metadata.items() if k != b"campaign.tokenizer_hash"}),
        anon / f.name,
    )
    with pytest.raises(TrainingError, match="records no tokenizer hash"):
        run_job(make_job(tmp_path / "n", demo_models["student"], anon, **kw), "n")


def test_sweep_rungs_stop_and_continue_to_the_adapter_of_one_run(run_job, tmp_path, demo_models, cipher_ds):
    """``stop_at_step`` (a sweep rung) checkpoints, measures the eval loss and exits; relaunching with a later
    stop and then none resumes each time from the rung's checkpoint, under the full run's LR schedule, and ends
    with exactly the adapter of an uninterrupted run (what lets student_adapter adopt a sweep's best trial)."""
    kw = dict(
        student=SMALL,
        max_steps=8,
        micro_batch_size=8,
        eval_rows=16,
        warmup_steps=2,
        checkpoint={"every_steps": None, "every_minutes": None, "keep_last": 2},
    )
    straight = run_job(make_job(tmp_path / "a", demo_models["student"], cipher_ds, **kw), "a")
    out = tmp_path / "b"
    rungs = []
    for i, stop in enumerate((2, 5, None)):
        job = make_job(out, demo_models["student"], cipher_ds, **kw).model_copy(update={"stop_at_step": stop})
        rungs.append(run_job(job, f"b{i}"))
    first, second, last = rungs
    assert first["rung"] and first["steps"] == 2 and first["trained_steps"] == 2 and first["resumed_from_step"] is None
    assert second["rung"] and second["trained_steps"] == 3 and second["resumed_from_step"] == 2
    assert first["eval_loss"] > second["eval_loss"] and first["eval_loss"] is not None
    assert "rung" not in last and last["resumed_from_step"] == 5 and last["trained_steps"] == 8
    a, b = _adapter(tmp_path / "a"), _adapter(out)
    for k in a:
        torch.testing.assert_close(b[k], a[k], rtol=0, atol=0, msg=k)
    assert last["eval_loss"] == pytest.approx(straight["eval_loss"], rel=1e-6)


def _base_means(base, ds, dtype: str) -> tuple[float, float]:
    """The base's next-token loss over every row of ``ds``: (the mean over loss tokens, the mean over examples of
    each example's mean), each example found by its ``position_ids`` restarting at 0."""
    from tests.support.train_scripts.example_losses import per_example
    from training import data as tdata

    model = _base_4bit(base, dtype)
    rows = tdata.load_rows(ds)
    parts = []
    with torch.no_grad():
        for i in range(len(rows)):
            b = tdata.collate(rows, [i], model.config.pad_token_id or 0, padding="longest")
            logits = model(**{k: v for k, v in b.items() if k not in tdata.NON_MODEL_KEYS}).logits[0]
            parts += per_example(logits, b["labels"][0], b["position_ids"][0])
    tokens = torch.cat(parts)
    return float(tokens.mean()), float(torch.stack([e.mean() for e in parts]).mean())


def test_example_normalization_weighs_each_example_once(run_job, tmp_path, demo_models):
    """``training.loss_normalization: example``: the first step's loss (one step over every row, before any update)
    is the base's mean over examples of each example's mean token loss; ``token`` is the mean over tokens. The
    dataset mixes short and many-word completions, so the two differ, and its rows collate ``free`` (the stage's
    default): the micro-batch is one row of every example back to back, told apart by their position_ids alone.
    The reference takes one example at a time."""
    from training import data as tdata

    ds = write_cipher_dataset(tmp_path / "ds", demo_models["student"], 24, seed=3, long_every=3, padding="free")
    n = len(tdata.load_rows(ds))
    student = small("float32") | {"lora": SMALL["lora"] | {"dropout": 0.0}}
    kw = dict(student=student, max_steps=1, micro_batch_size=n, gradient_accumulation_steps=1, eval_rows=1)
    by_token = run_job(make_job(tmp_path / "t", demo_models["student"], ds, **kw), "t")
    by_example = run_job(make_job(tmp_path / "e", demo_models["student"], ds, loss_normalization="example", **kw), "e")
    token_mean, example_mean = _base_means(demo_models["student"], ds, "float32")
    assert abs(token_mean - example_mean) > 0.05, (token_mean, example_mean)
    assert by_token["loss_normalization"] == "token" and by_example["loss_normalization"] == "example"
    assert by_token["first_loss"] == pytest.approx(token_mean, rel=2e-3)
    assert by_example["first_loss"] == pytest.approx(example_mean, rel=2e-3)
