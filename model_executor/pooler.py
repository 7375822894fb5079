"""Pooling a prompt's final hidden states into one embedding, for `--is-embedding`.

How, as the checkpoint's sentence-transformers files say: `modules.json` lists a Pooling module
(its `config.json`: `pooling_mode_mean_tokens`, `_cls_token` or `_lasttoken`) and perhaps a
Normalize module (L2 to unit length). A checkpoint without them (a causal LM) pools its last token
and normalizes, as SGLang and vLLM do. Pooling is float32, from the hidden states every TP rank
holds alike, so every rank computes the same embedding; the output rank sends it.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

POOLING_MODES = {"mean_tokens": "mean", "cls_token": "cls", "lasttoken": "last"}


@dataclass(frozen=True)
class Pooler:
    mode: str  # "mean" | "cls" | "last"
    normalize: bool

    @classmethod
    def of_checkpoint(cls, model_dir: Path) -> Pooler:
        """The checkpoint's sentence-transformers pooling, else last token, normalized. ValueError
        naming a pooling mode srt does not implement (max, mean_sqrt_len, weighted mean)."""
        modules_file = model_dir / "modules.json"
        if not modules_file.exists():
            return cls("last", True)
        modules = json.loads(modules_file.read_text())
        kinds = {str(m.get("type", "")).rsplit(".", 1)[-1]: m for m in modules}
        if "Pooling" not in kinds:
            return cls("last", "Normalize" in kinds)
        config = json.loads((model_dir / kinds["Pooling"]["path"] / "config.json").read_text())
        chosen = sorted(
            key.removeprefix("pooling_mode_")
            for key, on in config.items()
            if key.startswith("pooling_mode_") and on
        )
        if len(chosen) != 1 or chosen[0] not in POOLING_MODES:
            raise ValueError(
                f"{kinds['Pooling']['path']}/config.json: pooling {'+'.join(chosen) or 'none'} is not "
                f"implemented by srt (one of: {', '.join('pooling_mode_' + k for k in POOLING_MODES)})"
            )
        return cls(POOLING_MODES[chosen[0]], "Normalize" in kinds)

    def __call__(self, hidden: torch.Tensor, lengths: list[int]) -> torch.Tensor:
        """hidden [tokens, hidden] (each request's whole prompt, request after request) -> float32
        [requests, hidden]."""
        pooled = []
        start = 0
        for length in lengths:
            rows = hidden[start : start + length].float()
            if self.mode == "mean":
                pooled.append(rows.mean(dim=0))
            elif self.mode == "cls":
                pooled.append(rows[0])
            else:
                pooled.append(rows[-1])
            start += length
        out = torch.stack(pooled)
        return F.normalize(out, dim=-1) if self.normalize else out
