"""Merged-model export: the base in its compute dtype with the LoRA adapter folded in.

Merging into 4-bit weights would re-quantize and lose the adapter's precision, so the base is
loaded unquantized (``compute_dtype``) for the merge. The result is a plain checkpoint that
``AutoModelForCausalLM.from_pretrained`` (or vLLM) loads without PEFT.
"""

from __future__ import annotations

from pathlib import Path

import torch


def export_merged(base_model_path: str | Path, adapter_dir: str | Path, out_dir: str | Path,
                  dtype: torch.dtype = torch.bfloat16) -> Path:
    from peft import PeftModel
    from transformers import AutoModelForCausalLM, AutoTokenizer

    out = Path(out_dir)
    tmp = out.with_name(out.name + ".tmp")
    base = AutoModelForCausalLM.from_pretrained(str(base_model_path), dtype=dtype)
    merged = PeftModel.from_pretrained(base, str(adapter_dir)).merge_and_unload()
    merged.save_pretrained(str(tmp), safe_serialization=True)
    AutoTokenizer.from_pretrained(str(base_model_path)).save_pretrained(str(tmp))
    import shutil

    shutil.rmtree(out, ignore_errors=True)
    tmp.rename(out)
    return out
