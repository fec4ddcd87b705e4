"""Random-weight GGUFs at the shapes of released models, for speed measurements (weights do not change speed): a
checkpoint made by `transformers` at the model's shape (the tests' 768-token SentencePiece vocabulary, padded by the
converter to the model's vocabulary size), converted to F16 by the pinned llama.cpp source's `convert_hf_to_gguf.py`
and quantized to Q4_K_M by its `llama-quantize` (`python -m specdec.bench.llama_build` builds it).

    python scripts/shaped_model.py llama-3.2-1b OUT_DIR     # writes OUT_DIR/llama-3.2-1b-q4_k_m.gguf
    specdec bench -m OUT_DIR/llama-3.2-1b-q4_k_m.gguf --methods none,ngram-simple,llama-none --llama-server auto
"""

from __future__ import annotations

import argparse
import shutil
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
from families import convert, llama_quantize, make_checkpoint  # noqa: E402

SHAPES = {  # config.json values of the released models (sizes, attention layout, rope), on a random checkpoint
    "llama-3.2-1b": (
        "llama",
        dict(
            hidden_size=2048,
            intermediate_size=8192,
            num_hidden_layers=16,
            num_attention_heads=32,
            num_key_value_heads=8,
            head_dim=64,
            vocab_size=128256,
            tie_word_embeddings=True,
            max_position_embeddings=131072,
            rope_theta=500000.0,
            rope_scaling={
                "rope_type": "llama3",
                "factor": 32.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 8192,
            },
        ),
    ),
    "qwen3-0.6b": (
        "qwen3",
        dict(
            hidden_size=1024,
            intermediate_size=3072,
            num_hidden_layers=28,
            num_attention_heads=16,
            num_key_value_heads=8,
            head_dim=128,
            vocab_size=151936,
            tie_word_embeddings=True,
            max_position_embeddings=40960,
            rope_theta=1_000_000.0,
        ),
    ),
    "gemma-3-1b": (
        "gemma3_text",
        dict(
            hidden_size=1152,
            intermediate_size=6912,
            num_hidden_layers=26,
            num_attention_heads=4,
            num_key_value_heads=1,
            head_dim=256,
            query_pre_attn_scalar=256,
            vocab_size=262144,
            sliding_window=512,
            max_position_embeddings=32768,
            rope_theta=1_000_000.0,
            rope_local_base_freq=10_000.0,
        ),
    ),
    "olmo-2-1b": (  # OLMo-2-0425-1B
        "olmo2",
        dict(
            hidden_size=2048,
            intermediate_size=8192,
            num_hidden_layers=16,
            num_attention_heads=16,
            num_key_value_heads=16,
            vocab_size=100352,
            tie_word_embeddings=False,
            max_position_embeddings=4096,
            rope_theta=500000.0,
        ),
    ),
}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("shape", choices=sorted(SHAPES))
    ap.add_argument("out", type=Path)
    args = ap.parse_args()
    case, overrides = SHAPES[args.shape]
    hf = args.out / f"{args.shape}-hf"
    f16, q4 = args.out / f"{args.shape}-f16.gguf", args.out / f"{args.shape}-q4_k_m.gguf"
    make_checkpoint(hf, case, **overrides)
    convert(hf, "f16", f16, timeout=3600)
    shutil.rmtree(hf)
    if llama_quantize(f16, q4, "Q4_K_M", timeout=3600) is None:
        print("llama-quantize is not built: python -m specdec.bench.llama_build", file=sys.stderr)
        return 1
    f16.unlink()
    print(q4)
    return 0


if __name__ == "__main__":
    sys.exit(main())
