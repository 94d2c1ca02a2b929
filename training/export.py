"""Merged-model export: the base in its compute dtype with the LoRA adapter folded in.

Merging into 4-bit weights would re-quantize and lose the adapter's precision, so the base is
loaded unquantized (``compute_dtype``) for the merge. The result is a plain checkpoint that
``AutoModelForCausalLM.from_pretrained`` (or vLLM) loads without PEFT.
"""

from __future__ import annotations

from pathlib import Path

import torch

# What a serving stack needs beside the weights: the tokenizer (with its chat template) and the generation
# config (stop token ids). Copied from the base into every adapter and merged model, so evaluation and
# serving use exactly what training used.
SERVING_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "chat_template.jinja",
    "chat_template.json",
    "generation_config.json",
    "tokenizer.model",
    "vocab.json",
    "merges.txt",
)


def copy_serving_files(base_model_path: str | Path, out_dir: str | Path) -> list[str]:
    """Copy the base's tokenizer, chat template and generation config into ``out_dir``; the names copied."""
    import shutil

    copied = []
    for name in SERVING_FILES:
        src = Path(base_model_path) / name
        if src.is_file():
            shutil.copy2(src, Path(out_dir) / name)
            copied.append(name)
    return copied


def export_merged(
    base_model_path: str | Path, adapter_dir: str | Path, out_dir: str | Path, dtype: torch.dtype = torch.bfloat16
) -> Path:
    from peft import PeftModel
    from transformers import AutoModelForCausalLM, AutoTokenizer

    out = Path(out_dir)
    tmp = out.with_name(out.name + ".tmp")
    base = AutoModelForCausalLM.from_pretrained(str(base_model_path), dtype=dtype)
    merged = PeftModel.from_pretrained(base, str(adapter_dir)).merge_and_unload()
    merged.save_pretrained(str(tmp), safe_serialization=True)
    AutoTokenizer.from_pretrained(str(base_model_path)).save_pretrained(str(tmp))
    copy_serving_files(base_model_path, tmp)
    import shutil

    shutil.rmtree(out, ignore_errors=True)
    tmp.rename(out)
    return out
