"""llama.cpp as a bench peer: a `llama-server` binary on loopback, timed through its `/completion` API."""

from __future__ import annotations

import json
import re
import socket
import subprocess
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, replace
from pathlib import Path

from specdec import paths
from specdec.bench.methods import Method, Output, strip_stop
from specdec.bench.report import Outcomes, Skip
from specdec.errors import SpecdecError

# bench method -> llama.cpp `--spec-type` (None: plain decoding)
LLAMA_METHODS = {
    "llama-none": None,
    "llama-draft": "draft-simple",
    "llama-ngram-simple": "ngram-simple",
    "llama-ngram-mod": "ngram-mod",
    "llama-ngram-map-k": "ngram-map-k",
    "llama-ngram-map-k4v": "ngram-map-k4v",
    "llama-eagle3": "draft-eagle3",
    "llama-mtp": "draft-mtp",  # the GGUF's own nextn / MTP layers, or -md a Gemma 4 assistant
}
HEAD_PEERS = ("llama-eagle3", "llama-mtp")  # need a trained head or MTP layers: in `--methods all` only when named
# GGUF architectures of the models specdec loads whose llama.cpp graph (src/models/ARCH.cpp of the pinned llama.cpp)
# records each layer's input (`t_layer_inp`), which its EAGLE-3 reads; on others llama-server aborts at warm-up
EAGLE3_ARCHS = ("llama", "qwen3", "qwen3moe")
# n-gram pools kept across requests in the server; a repeat of a prompt is not first-seen there
STATEFUL = ("llama-ngram-mod", "llama-ngram-map-k", "llama-ngram-map-k4v")
STARTUP_S = 600


@dataclass(frozen=True)
class ServerConfig:
    binary: str
    gguf: Path
    draft_gguf: Path | None
    threads: int
    context: int
    temperature: float
    draft_max: int
    draft_min: int
    draft_p_min: float
    ngram_n: int
    ngram_m: int
    eagle3_gguf: Path | None = None  # our EAGLE-3 head in llama.cpp's eagle3 GGUF (for llama-eagle3)
    extra: tuple[str, ...] = ()  # more flags, as given (e.g. -ctk f32 -ctv f32)


def _lists(help_text: str, word: str) -> bool:
    """Whether `word` (a flag or a value) appears as a whole word in the `--help` text."""
    return re.search(rf"(?<![\w-]){re.escape(word)}(?![\w-])", help_text) is not None


def _first_flag(help_text: str, *names: str) -> str | None:
    return next((n for n in names if _lists(help_text, n)), None)


def server_command(method: str, cfg: ServerConfig, help_text: str, port: int) -> list[str]:
    """The `llama-server` command line for `method`, with the flag names this binary's `--help` lists; Skip when
    this binary or these settings cannot run it."""
    cmd = [
        cfg.binary,
        "-m",
        str(cfg.gguf),
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "-c",
        str(cfg.context),
        "-np",
        "1",
        "-t",
        str(cfg.threads),
        "-tb",
        str(cfg.threads),
        "--temp",
        str(cfg.temperature),
        *cfg.extra,
    ]
    spec = LLAMA_METHODS[method]
    if spec is None:
        return cmd
    if spec == "draft-simple":
        if cfg.draft_gguf is None:
            raise Skip(f"{method} needs the draft model as a GGUF (-md pack name or .gguf)")
        cmd += ["-md", str(cfg.draft_gguf)]
        if _lists(help_text, "draft-simple"):  # newer servers name the draft-model drafter explicitly
            cmd += ["--spec-type", "draft-simple"]
    elif spec == "draft-eagle3" and cfg.eagle3_gguf is None:
        raise Skip(f"{method} needs an EAGLE-3 head for the target (specdec train eagle3, or --spec-eagle3-head DIR)")
    elif _lists(help_text, "--spec-type") and _lists(help_text, spec):
        head = {"draft-eagle3": cfg.eagle3_gguf, "draft-mtp": cfg.draft_gguf}.get(spec)  # (mtp: a Gemma 4 assistant)
        cmd += (["-md", str(head)] if head is not None else []) + ["--spec-type", spec]
    else:
        raise Skip(f"this llama-server has no --spec-type {spec}")
    for value, names in (
        (cfg.draft_max, ("--spec-draft-n-max", "--draft-max", "--draft-n")),
        (cfg.draft_min, ("--spec-draft-n-min", "--draft-min")),
        (cfg.draft_p_min, ("--spec-draft-p-min", "--draft-p-min")),
    ):
        flag = _first_flag(help_text, *names)
        if flag:
            cmd += [flag, str(value)]
    if spec in ("ngram-simple", "ngram-map-k", "ngram-map-k4v"):  # our -n / -m (ngram-mod keeps its own)
        for n_flag, m_flag in (
            (f"--spec-{spec}-size-n", f"--spec-{spec}-size-m"),
            ("--spec-ngram-size-n", "--spec-ngram-size-m"),
        ):
            if _lists(help_text, n_flag) and _lists(help_text, m_flag):
                cmd += [n_flag, str(cfg.ngram_n), m_flag, str(cfg.ngram_m)]
                break
    return cmd


def server_help(binary: str) -> str:
    """`binary --help` (stdout and stderr), to pick the flag names this build has."""
    try:
        res = subprocess.run([binary, "--help"], capture_output=True, text=True, timeout=120)
    except (OSError, subprocess.TimeoutExpired) as e:
        raise SpecdecError(f"cannot run {binary} --help: {e}") from None
    return res.stdout + res.stderr


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class LlamaServer:
    """One `llama-server` process on 127.0.0.1; its output goes to `log`."""

    def __init__(self, method: str, cfg: ServerConfig, help_text: str, log: Path):
        port = _free_port()
        self.cmd = server_command(method, cfg, help_text, port)
        self.url, self.log = f"http://127.0.0.1:{port}", log
        with open(log, "wb") as f:
            self.proc = subprocess.Popen(self.cmd, stdout=f, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
        self._wait_ready()

    def _wait_ready(self) -> None:
        deadline = time.monotonic() + STARTUP_S
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                tail = self.log.read_text(errors="replace").strip().splitlines()[-1:]
                raise SpecdecError(
                    f"llama-server exited with code {self.proc.returncode} "
                    f"({tail[0] if tail else 'no output'}; log: {self.log})"
                )
            try:
                with urllib.request.urlopen(self.url + "/health", timeout=5) as r:
                    if r.status == 200:
                        return
            except (urllib.error.URLError, OSError):
                pass
            time.sleep(0.5)
        self.close()
        raise SpecdecError(f"llama-server did not become ready in {STARTUP_S} s (log: {self.log})")

    def complete(self, body: dict) -> dict:
        req = urllib.request.Request(
            self.url + "/completion", data=json.dumps(body).encode(), headers={"Content-Type": "application/json"}
        )
        try:
            with urllib.request.urlopen(req, timeout=3600) as r:
                return json.loads(r.read())
        except (urllib.error.URLError, OSError, ValueError) as e:
            raise SpecdecError(f"llama-server request failed: {e} (log: {self.log})") from None

    def peak_rss_mb(self) -> float | None:
        try:
            status = Path(f"/proc/{self.proc.pid}/status").read_text()
        except OSError:
            return None
        m = re.search(r"VmHWM:\s+(\d+) kB", status)
        return int(m.group(1)) / 1024 if m else None

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


class Llama(Method):
    """A llama.cpp speculative setup; the same token ids go in as a token list, no prompt cache."""

    def __init__(self, name: str, server: LlamaServer, stop_ids: set[int]):
        self.name, self.baseline, self.server, self.stop_ids = name, "llama-none", server, stop_ids
        self.fresh_repeats = name not in STATEFUL

    def generate(self, ids: list[int], max_tokens: int, temperature: float, seed: int | None) -> Output:
        body = {
            "prompt": ids,
            "n_predict": max_tokens,
            "cache_prompt": False,
            "temperature": temperature,
            "return_tokens": True,
            "stream": False,
        }
        if seed is not None:
            body["seed"] = seed
        t0 = time.perf_counter()
        resp = self.server.complete(body)
        wall = time.perf_counter() - t0
        if "tokens" not in resp:
            raise SpecdecError("llama-server returned no token ids (needs `return_tokens` support)")
        timings = resp.get("timings") or {}
        ms = lambda k: timings[k] / 1000 if isinstance(timings.get(k), (int, float)) else None  # noqa: E731
        prompt_s, predicted_s = ms("prompt_ms"), ms("predicted_ms")
        tokens = strip_stop(resp["tokens"], self.stop_ids)
        # `timings` leaves the draft counts out when nothing was drafted; every target forward after the
        # prompt yields its accepted drafts plus one token of its own
        drafted, accepted = timings.get("draft_n", 0), timings.get("draft_n_accepted", 0)
        return Output(
            tokens,
            wall,
            target_forwards=len(tokens) - accepted,
            drafted=drafted,
            accepted=accepted,
            prefill_s=prompt_s,
            server_s=prompt_s + predicted_s if prompt_s is not None and predicted_s is not None else None,
            peak_rss_mb=self.server.peak_rss_mb(),
        )

    def close(self) -> None:
        self.server.close()


def gguf_file(model: str | None) -> Path | None:
    """The GGUF behind a model argument: a pack's downloaded file or a GGUF path; None for a checkpoint dir."""
    from specdec.models import packs

    if model is None:
        return None
    path = packs.gguf_path(model) if model in packs.PACKS else Path(model).expanduser()
    return path if path.is_file() else None


def check_eagle3_target(target_gguf: Path) -> None:
    """Skip unless llama.cpp's EAGLE-3 can run on this target: its architecture must be one of EAGLE3_ARCHS."""
    from specdec.plan.specs import read_gguf_header

    arch = read_gguf_header(target_gguf).meta.get("general.architecture")
    if arch not in EAGLE3_ARCHS:
        raise Skip(f"llama.cpp's EAGLE-3 needs layer inputs its {arch} graph does not expose")


def eagle3_gguf(model: str, choice: str, target_gguf: Path) -> Path:
    """Our EAGLE-3 head for the target (`--spec-eagle3-head`, or the one `--spec-type eagle3` finds) in llama.cpp's
    `eagle3` GGUF (`save_gguf`: the tensors and keys the pinned llama.cpp's `convert_hf_to_gguf.py` writes,
    tests/test_eagle3_conformance.py), written under `$SPECDEC_HOME/llama.cpp/eagle3` (never inside the package)
    once per head and target, and again when either is newer."""
    import hashlib

    from specdec.drafters.heads import find_head
    from specdec.models.eagle3 import load_head
    from specdec.models.eagle3_gguf import save_gguf
    from specdec.models.gguf_convert import config_from_gguf, open_gguf

    head_dir = (find_head(model, "eagle3", "--spec-eagle3-head") if choice == "auto" else Path(choice)).resolve()
    target_gguf = target_gguf.resolve()
    key = hashlib.sha256(f"{head_dir}\0{target_gguf}".encode()).hexdigest()[:12]
    out = paths.home() / "llama.cpp" / "eagle3" / f"{head_dir.name}-{key}.gguf"
    sources = (head_dir / "model.safetensors", target_gguf)
    if not out.is_file() or out.stat().st_mtime < max(f.stat().st_mtime for f in sources):
        out.parent.mkdir(parents=True, exist_ok=True)
        layers = config_from_gguf(open_gguf(target_gguf), target_gguf).num_layers
        save_gguf(load_head(head_dir, layers), out, target_gguf)
    return out


def llama_methods(
    names: list[str], args, context: int, stop_ids: set[int], log_dir: Path, outcomes: Outcomes, meta: dict
) -> list[Llama]:
    """Start one server per requested `llama-*` method; one this peer cannot run is skipped, one whose setup or
    start fails is failed, each with its reason in `outcomes`."""
    setup = outcomes.attempt(names, "loading", lambda: server_setup(args, context)) if names else None
    if setup is None:
        return []
    cfg, help_text = setup
    meta["llama_server"] = {"binary": args.llama_server, "commands": {}}
    started: list[Llama] = []
    try:
        for name in names:
            method = outcomes.attempt([name], "loading", lambda: start(name, cfg, help_text, args, stop_ids, log_dir))
            if method is None:
                continue
            meta["llama_server"]["commands"][name] = " ".join(method.server.cmd)
            started.append(method)
            if name in STATEFUL and args.repeat > 1:
                outcomes.notes.append(
                    f"{name} keeps n-gram state across requests: only its first run of each "
                    "prompt counts in the summary"
                )
    except BaseException:  # Ctrl-C: no server left behind
        for m in started:
            m.close()
        raise
    return started


def server_setup(args, context: int) -> tuple[ServerConfig, str]:
    """The servers' settings and the binary's `--help`; Skip without a binary or a GGUF target."""
    if not args.llama_server:
        raise Skip("no --llama-server PATH given")
    target = gguf_file(args.model)
    if target is None:
        raise Skip("llama.cpp needs the target as a GGUF (-m pack name or .gguf)")
    cfg = ServerConfig(
        args.llama_server,
        target,
        gguf_file(args.draft),
        args.threads,
        context,
        args.temp,
        args.draft_max,
        args.draft_min,
        args.draft_p_min,
        args.ngram_n,
        args.ngram_m,
    )
    return cfg, server_help(args.llama_server)


def start(name: str, cfg: ServerConfig, help_text: str, args, stop_ids: set[int], log_dir: Path) -> Llama:
    """`name` on a started server; Skip, before anything starts, when this target or binary cannot run it."""
    if name == "llama-eagle3":
        check_eagle3_target(cfg.gguf)
        cfg = replace(cfg, eagle3_gguf=eagle3_gguf(args.model, getattr(args, "eagle3_head", "auto"), cfg.gguf))
    return Llama(name, LlamaServer(name, cfg, help_text, log_dir / f"{name}.log"), stop_ids)
