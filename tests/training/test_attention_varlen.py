"""The ``varlen`` attention kernel (training.attention): one variable-length call per packed row, equal to eager
attention over the block-diagonal mask, outputs and gradients, with grouped-query attention.

On a CPU neither fused backend trains (torch's ``varlen_attn`` is CUDA-only, FlexAttention has no backward there),
so the model-level test runs the CPU fallback, the flash path runs against a reference ``varlen_attn`` (same
signature and layout, per-sequence sdpa inside: what is checked is this module's reshapes, cumulative lengths,
causal and GQA arguments), and FlexAttention's document mask is checked forward only."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from tests.support.attention_support import llama_pair, logits_and_grads
from training import attention

HEADS, KV, D = 4, 2, 8


def _eager(q, k, v, lengths_per_row, scale):
    """transformers' eager attention under the block-diagonal causal mask of each row."""
    from transformers.models.llama.modeling_llama import eager_attention_forward

    class _Layer(nn.Module):
        num_key_value_groups = q.size(1) // k.size(1)

    masks = []
    for lengths in lengths_per_row:
        _, additive = attention._block_masks(lengths, q.device)
        masks.append(additive[0])
    return eager_attention_forward(_Layer().train(), q, k, v, torch.stack(masks), scaling=scale)[0]


def _inputs(lengths_per_row, seed=0):
    g = torch.Generator().manual_seed(seed)
    b, t = len(lengths_per_row), sum(lengths_per_row[0])
    q = torch.randn(b, HEADS, t, D, generator=g, dtype=torch.float32)
    k = torch.randn(b, KV, t, D, generator=g, dtype=torch.float32)
    v = torch.randn(b, KV, t, D, generator=g, dtype=torch.float32)
    pos = torch.stack([torch.cat([torch.arange(n) for n in lengths]) for lengths in lengths_per_row])
    return q, k, v, pos


def _reference_varlen(signature: str):
    """A stand-in for ``torch.nn.attention.varlen.varlen_attn`` with the signature of torch 2.10 (``is_causal``) or
    2.11+ (``window_size``, ``enable_gqa``): ``[tokens, heads, D]`` in and out, sequences from ``cu_seq``."""
    calls = []

    def run(q, k, v, cu_q, cu_k, max_q, max_k, scale, causal, gqa):
        assert cu_q.dtype == torch.int32 and torch.equal(cu_q, cu_k) and causal
        lengths = (cu_q[1:] - cu_q[:-1]).tolist()
        assert max_q == max_k == max(lengths) and int(cu_q[-1]) == q.size(0)
        calls.append((lengths, gqa, k.size(1)))
        outs = []
        for s, e in zip(cu_q[:-1].tolist(), cu_q[1:].tolist(), strict=True):
            o = nn.functional.scaled_dot_product_attention(
                q[s:e].transpose(0, 1),
                k[s:e].transpose(0, 1),
                v[s:e].transpose(0, 1),
                is_causal=True,
                scale=scale,
                enable_gqa=gqa,
            )
            outs.append(o.transpose(0, 1))
        return torch.cat(outs)

    if signature == "2.11":

        def varlen_attn(
            query,
            key,
            value,
            cu_seq_q,
            cu_seq_k,
            max_q,
            max_k,
            *,
            return_aux=None,
            scale=None,
            window_size=(-1, -1),
            enable_gqa=False,
        ):
            return run(
                query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, scale, tuple(window_size) == (-1, 0), enable_gqa
            )
    else:

        def varlen_attn(
            query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, is_causal=False, return_aux=None, scale=None
        ):
            return run(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, scale, is_causal, False)

    return varlen_attn, calls


@pytest.mark.parametrize("signature", ["2.11", "2.10"])
@pytest.mark.parametrize("rows", [[[6, 4, 5]], [[9], [6, 3]]], ids=["packed_row", "two_rows"])
def test_flash_varlen_path_equals_eager_outputs_and_gradients(monkeypatch, signature, rows):
    fake, calls = _reference_varlen(signature)
    monkeypatch.setattr(attention, "flash_varlen", lambda: fake)
    monkeypatch.setattr(attention, "_varlen_kwargs", None)
    q, k, v, pos = _inputs(rows)
    layer = nn.Module().train()
    leaves = [x.clone().requires_grad_() for x in (q, k, v)]
    out, _ = attention.varlen_forward(layer, *leaves, None, scaling=D**-0.5, position_ids=pos, backend="flash_varlen")
    ref_leaves = [x.clone().requires_grad_() for x in (q, k, v)]
    ref = _eager(*ref_leaves, rows, D**-0.5)
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
    w = torch.randn_like(ref)
    (out * w).sum().backward()
    (ref * w).sum().backward()
    for a, b, name in zip(leaves, ref_leaves, "qkv", strict=True):
        torch.testing.assert_close(a.grad, b.grad, rtol=1e-4, atol=1e-5, msg=name)
    # one call for the whole batch, every sequence of every row in it; GQA native on 2.11, kv repeated on 2.10
    assert [c[0] for c in calls] == [[n for r in rows for n in r]]
    assert calls[0][1:] == ((True, KV) if signature == "2.11" else (False, HEADS))


def test_flex_document_mask_equals_eager_forward():
    rows = [[9], [6, 3]]
    q, k, v, pos = _inputs(rows, seed=2)
    with torch.no_grad():
        out, _ = attention.varlen_forward(
            nn.Module().eval(), q, k, v, None, scaling=D**-0.5, position_ids=pos, backend="flex"
        )
        torch.testing.assert_close(out, _eager(q, k, v, rows, D**-0.5), rtol=1e-5, atol=1e-5)


@pytest.fixture(scope="module")
def models():
    return llama_pair(attention.VARLEN)


_grads = logits_and_grads


@pytest.mark.parametrize("backend", ["cpu_fallback", "flash_varlen"])
def test_a_model_on_varlen_equals_eager_on_a_packed_row(models, monkeypatch, backend):
    """transformers calls the registered kernel (GQA: 4 heads on 2 kv heads); on a CPU it is segment_eager, and the
    flash path (through the reference varlen_attn) computes the same logits and gradients."""
    if backend == "flash_varlen":
        fake, calls = _reference_varlen("2.11")
        monkeypatch.setattr(attention, "flash_varlen", lambda: fake)
        monkeypatch.setattr(attention, "_varlen_kwargs", None)
        monkeypatch.setattr(attention, "varlen_backend", lambda device, dtype=None: "flash_varlen")
    assert attention.varlen_backend(torch.device("cpu")) == (
        "flash_varlen" if backend == "flash_varlen" else attention.NAME
    )
    eager, var = models
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(3, 61, (1, 15), generator=g)
    pos = torch.cat([torch.arange(6), torch.arange(4), torch.arange(5)]).unsqueeze(0)
    le, ge = _grads(eager, input_ids=ids, position_ids=pos)
    lv, gv = _grads(var, input_ids=ids, position_ids=pos)
    torch.testing.assert_close(lv, le, rtol=1e-5, atol=1e-5)
    for n in ge:
        torch.testing.assert_close(gv[n], ge[n], rtol=1e-4, atol=1e-6, msg=n)
    if backend == "flash_varlen":  # one call per layer, the whole row's sequences in it
        assert len(calls) == var.config.num_hidden_layers and calls[0][0] == [6, 4, 5]


def test_varlen_is_a_measured_candidate_only_where_it_has_a_kernel(monkeypatch):
    assert attention.varlen_backend(torch.device("cpu")) == attention.NAME
    assert attention.candidates(torch.device("cpu")) == attention.CANDIDATES  # on a CPU it is segment_eager again
    assert list(attention.kernel_steps(torch.device("cpu"))) == list(attention.CANDIDATES)
    cuda = torch.device("cuda", 0)
    expected = "flash_varlen" if attention.flash_varlen() is not None else "flex"
    assert attention.varlen_backend(cuda) == expected
    assert attention.varlen_backend(cuda, torch.float32) == "flex"  # flash kernels take half precision only
    assert attention.candidates(cuda) == (*attention.CANDIDATES, attention.VARLEN)
    assert list(attention.kernel_steps(cuda)) == [*attention.CANDIDATES, attention.VARLEN]  # measured, not assumed
    monkeypatch.setattr(attention, "flash_varlen", lambda: None)
    assert attention.varlen_backend(cuda) == "flex"  # a torch without varlen_attn: FlexAttention's document mask


# --------------------------------------------------------------------------- the choice, by real timings

REPEATS = 8  # the planted kernel does this many times a real kernel's work: at least 5x slower by construction


def repeated(step, times: int = REPEATS):
    """A real kernel made ``times`` times slower for real: it computes the attention ``times`` times and averages
    the outputs, so forward and backward both run every copy."""

    def slow(layer, q, k, v, **kw):
        out = step(layer, q, k, v, **kw)
        for _ in range(times - 1):
            out = out + step(layer, q, k, v, **kw)
        return out / times

    return slow


@pytest.fixture
def one_thread():
    """One intra-op thread, as the local launcher gives each training rank: on a loaded 2-core host a 2-thread
    kernel waits on its slower thread every round (the rounds then vary tenfold), one thread needs one free core."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def test_the_kernel_is_chosen_by_real_timings_and_a_planted_slow_kernel_is_never_chosen(tmp_path, one_thread):
    """The real selection among the CPU candidates (eager, sdpa, segment_eager: timed forward + backward, best of 5
    after a warm-up, taking turns), with a slowed copy of each planted beside it: the same kernel repeating its work
    8 times. Whatever the load on the host, no planted copy is ever chosen: a busy core only ever slows a round
    down, and each kernel keeps its best round. No timing is replaced."""
    from transformers import LlamaConfig

    cfg = LlamaConfig(hidden_size=64, num_attention_heads=4, num_key_value_heads=2)
    cpu = torch.device("cpu")
    shape = {"row_tokens": 192, "seq_len": 48}
    chosen, rec = attention.choose_kernel(cfg, cpu, **shape, cache_dir=str(tmp_path / "real"))
    assert chosen in attention.CANDIDATES and set(rec["seconds"]) == set(attention.CANDIDATES)
    assert rec["measured_now"] and chosen == min(rec["seconds"], key=rec["seconds"].get)
    real = attention.kernel_steps(cpu)
    planted = {f"{k}_x{REPEATS}": repeated(step) for k, step in real.items()}
    for trial in range(3):
        kernel, r = attention.choose_kernel(
            cfg, cpu, **shape, cache_dir=str(tmp_path / f"planted{trial}"), kernels=real | planted
        )
        s = r["seconds"]
        assert r["measured_now"] and set(s) == set(real) | set(planted), s
        assert kernel in real and kernel == min(s, key=s.get), s


@pytest.mark.slow  # two processes (torch and transformers imported in each)
def test_processes_asking_together_record_one_measurement(tmp_path):
    """Two processes reach the measurement at the same instant (each says it is ready after its imports, then waits
    for the go both get at once): exactly one measures, under the lock beside the cache file, the other waits and
    reads its record."""
    import json
    import subprocess
    import sys

    from tests.support import REPO_ROOT
    from tests.support.train_support import child_env

    code = f"""
import json, sys
import torch
from transformers import LlamaConfig
from training import attention
print("ready", flush=True)
sys.stdin.readline()
kernel, rec = attention.choose_kernel(
    LlamaConfig(hidden_size=64, num_attention_heads=4, num_key_value_heads=2), torch.device("cpu"),
    row_tokens=192, seq_len=48, cache_dir={str(tmp_path / "cache")!r})
print(json.dumps({{"kernel": kernel, "measured_now": rec["measured_now"]}}), flush=True)
"""
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", code],
            cwd=REPO_ROOT,
            env=child_env(),
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )
        for _ in range(2)
    ]
    for p in procs:
        assert p.stdout.readline().strip() == "ready"
    for p in procs:
        p.stdin.write("go\n")
        p.stdin.flush()
    outs = [json.loads(p.communicate(timeout=300)[0].strip().splitlines()[-1]) for p in procs]
    assert all(p.returncode == 0 for p in procs)
    assert sorted(o["measured_now"] for o in outs) == [False, True], outs
    assert outs[0]["kernel"] == outs[1]["kernel"]
    cached = json.loads((tmp_path / "cache" / attention.CACHE_FILE).read_text())
    assert len(cached) == 1
