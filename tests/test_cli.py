"""CLI: JSON output on a real model, and every kind of bad input is one line + non-zero exit."""

import json
import subprocess
import sys

import pytest
from conftest import make_tiny


def run(*args, env=None):
    return subprocess.run(
        [sys.executable, "-m", "specdec.cli", *args], capture_output=True, text=True, env=env, timeout=300
    )


def assert_clean_error(res, needle):
    assert res.returncode != 0
    assert "Traceback" not in res.stderr
    lines = [line for line in res.stderr.splitlines() if line.strip()]
    assert len(lines) == 1, res.stderr
    assert needle in lines[0], lines[0]


@pytest.mark.real
def test_generate_json(smollm_dir):
    res = run(
        "generate",
        "-m",
        str(smollm_dir),
        "-p",
        "The capital of France is",
        "-n",
        "12",
        "--dtype",
        "fp32",
        "--spec-type",
        "ngram-simple",
        "--json",
    )
    assert res.returncode == 0, res.stderr
    out = json.loads(res.stdout)
    assert set(out) >= {"text", "token_ids", "stats"}
    assert set(out["stats"]) == {
        "new_tokens",
        "target_forwards",
        "drafted",
        "accepted",
        "relaxed",
        "acceptance_rate",
        "mean_accept_len",
        "tokens_per_s",
    }
    assert out["stats"]["new_tokens"] == len(out["token_ids"]) <= 12


def test_missing_model_path(tmp_path):
    assert_clean_error(run("generate", "-m", str(tmp_path / "nope.gguf"), "-p", "hi"), "model not found")


def test_corrupt_gguf(tmp_path):
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"GGUF" + b"\x00garbage" * 100)
    assert_clean_error(run("generate", "-m", str(bad), "-p", "hi"), "not a readable GGUF")


@pytest.mark.real
def test_truncated_gguf(tmp_path):
    from specdec.models.packs import gguf_path

    cut = tmp_path / "cut.gguf"
    cut.write_bytes(gguf_path("smollm2-135m").read_bytes()[:3_000_000])
    assert_clean_error(run("generate", "-m", str(cut), "-p", "hi"), "not a readable GGUF")


def test_unsupported_architecture(tmp_path, tiny_dir):
    d = tmp_path / "gpt2"
    d.mkdir()
    (d / "config.json").write_text(json.dumps({"model_type": "gpt2", "vocab_size": 10}))
    (d / "model.safetensors").write_bytes(b"")
    assert_clean_error(run("generate", "-m", str(d), "-p", "hi"), "unsupported architecture 'gpt2'")


@pytest.mark.real
def test_draft_with_other_tokenizer(smollm_dir, tiny_dir):
    """A draft model with another tokenizer drafts across tokenizers (docs/cross-tokenizer.md): not an error; the
    default spec type with a draft model is the suffix tree, then the draft model."""
    from specdec.drafters import DEFAULT_WITH_DRAFT_MODEL

    res = run(
        "generate",
        "-m",
        str(smollm_dir),
        "-md",
        str(tiny_dir("llama")),
        "-p",
        "hi",
        "-n",
        "8",
        "--dtype",
        "fp32",
        "--json",
    )
    assert res.returncode == 0, res.stderr
    assert json.loads(res.stdout)["spec_type"] == DEFAULT_WITH_DRAFT_MODEL == "suffix-tree,draft"


def test_prompt_longer_than_context(tiny_dir):
    res = run("generate", "-m", str(tiny_dir("llama")), "-p", "t3 " * 40, "-c", "16", "--dtype", "fp32")
    assert_clean_error(res, "prompt has 40 tokens but the context is 16")


@pytest.mark.parametrize(
    "flags,needle",
    [
        (["--draft-max", "0"], "must be >= 1"),
        (["--temp", "-1"], "temperature must be >= 0"),
        (["--top-p", "2"], "top_p must be in (0, 1]"),
        (["--spec-type", "magic"], "unknown spec type 'magic'"),
        (["--spec-type", "ngram-mod,none"], "cannot contain 'none'"),
        (["--spec-ngram-min-hits", "0"], "must be >= 1"),
        (["--spec-ngram-mod-pool-mb", "0"], "ngram_mod_pool_mb must be in (0, 65536]"),
        (["--spec-suffix-max-requests", "-1"], "suffix_max_requests must be >= 0"),
        (["--spec-suffix-factor", "0"], "suffix_factor must be > 0"),
        (["--spec-suffix-min-prob", "2"], "must be in [0, 1]"),
        (["--draft-p-min", "1.5"], "must be in [0, 1]"),
        (["-n", "abc"], "invalid _positive_int value"),
        (["--draft-min", "20", "--draft-max", "4"], "draft_min must be between 0 and draft_max"),
    ],
)
def test_bad_flags(tiny_dir, flags, needle):
    res = run("generate", "-m", str(tiny_dir("llama")), "-p", "t3", "--dtype", "fp32", *flags)
    assert_clean_error(res, needle)


def test_missing_prompt_file(tiny_dir, tmp_path):
    res = run("generate", "-m", str(tiny_dir("llama")), "-f", str(tmp_path / "none.txt"))
    assert_clean_error(res, "cannot read prompt file")


def test_models_list():
    res = run("models", "list")
    assert res.returncode == 0
    assert "qwen2.5-coder-1.5b" in res.stdout and "smollm2-135m" in res.stdout


def test_tiny_generate_human_output(tmp_path):
    d = make_tiny(tmp_path / "m", "qwen2")
    res = run("generate", "-m", str(d), "-p", "t5 t9", "-n", "5", "--dtype", "fp32", "--spec-type", "ngram-simple")
    assert res.returncode == 0, res.stderr
    assert "tok/s" in res.stderr


def test_usage_version_hubs_and_stdin(tiny_dir):
    """`specdec` alone: the usage with its commands (exit 2); --version; -hf: one line saying hubs are not reachable
    and what to do instead; -f -: the prompt from standard input."""
    bare = run()
    assert bare.returncode == 2 and "generate" in bare.stderr and "serve" in bare.stderr
    version = run("--version")
    assert version.returncode == 0 and version.stdout.startswith("specdec ")
    assert_clean_error(run("generate", "-hf", "org/repo", "-p", "hi"), "use a model pack")
    res = subprocess.run(
        [
            sys.executable,
            "-m",
            "specdec.cli",
            "generate",
            "-m",
            str(tiny_dir("qwen2")),
            "-f",
            "-",
            "-n",
            "3",
            "--dtype",
            "fp32",
            "--ignore-eos",
            "--json",
        ],
        input="t5 t9",
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert res.returncode == 0, res.stderr
    assert json.loads(res.stdout)["stats"]["new_tokens"] == 3


def test_python_api_names_the_keyword_meant(tiny_dir):
    import specdec
    from specdec.errors import SpecdecError

    with pytest.raises(SpecdecError, match="use context="):
        specdec.LLM(str(tiny_dir("llama")), n_ctx=2048, progress=False)
    llm = specdec.LLM(str(tiny_dir("llama")), dtype="fp32", progress=False)
    with pytest.raises(SpecdecError, match="use max_tokens="):
        llm.generate("t1", max_new_tokens=8)
