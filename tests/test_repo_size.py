"""The repository stays lean: no tracked file over 2 MiB; the code, docs, reports and data together at most
8 MiB; the committed experiment runs at most 16 MiB, each run's folder at most 48 KiB. The runs have a
budget of their own because the evidence grows with them (several hundred runs of 10-40 KB each, thinned),
while everything else should not grow much: 10 MiB held until the 5-seed learning-rate sweep (270 runs)
and the additive experiment (130) came in, about 17 KB a run; 14 MiB until the routing 2 x 2's 5-seed
cells (70 runs, 50 of them copies of additive runs: an experiment holds the runs its report reads); the
last 2 MiB leave room for the scaling experiments' 5 seeds (48 more runs).

Tracked means ``git ls-files``; a file's size is its size in the working tree (what a checkout holds,
a symlink counted as the link). Outside a git checkout of this repository (an sdist, an installed
copy, no git) the tests skip. Experiment runs are committed thinned: ``scripts/downsample_runs.py``
(see experiments/README.md).
"""

import os
import shutil
import stat
import subprocess
from collections import Counter
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
MiB = 1 << 20
MAX_FILE = 2 * MiB
MAX_OTHER = 8 * MiB
MAX_RUNS = 16 * MiB
MAX_RUN = 48 * 1024
RUNS = "experiments/runs/"


def _mib(n: int) -> str:
    return f"{n / MiB:.2f} MiB"


def tracked_sizes(root: Path = ROOT) -> dict[str, int]:
    """path -> bytes of every tracked file present in the working tree; skips outside a checkout."""
    git = shutil.which("git")
    if git is None:
        pytest.skip("git is not installed")
    try:
        top = subprocess.run(
            [git, "rev-parse", "--show-toplevel"], cwd=root, capture_output=True, text=True, timeout=60
        )
        if top.returncode != 0 or Path(top.stdout.strip()).resolve() != root.resolve():
            pytest.skip(f"{root} is not the top of a git checkout")
        listing = subprocess.run([git, "ls-files", "-z"], cwd=root, capture_output=True, check=True, timeout=60).stdout
    except (OSError, subprocess.SubprocessError) as e:
        pytest.skip(f"git ls-files failed: {e}")
    sizes = {}
    for raw in listing.split(b"\0"):
        if not raw:
            continue
        name = os.fsdecode(raw)
        try:
            st = os.lstat(root / name)
        except FileNotFoundError:  # deleted in the working tree, deletion not committed yet
            continue
        if stat.S_ISREG(st.st_mode) or stat.S_ISLNK(st.st_mode):  # not a submodule's folder
            sizes[name] = st.st_size
    return sizes


def biggest(sizes: dict[str, int], n: int = 10) -> str:
    """The largest folders (two levels deep) and files, one per line."""
    folders = Counter()
    for name, size in sizes.items():
        folders["/".join(name.split("/")[:-1][:2]) or "."] += size
    lines = ["largest folders (two levels, everything below them):"]
    lines += [f"  {_mib(size):>11}  {name}/" for name, size in folders.most_common(n)]
    lines += ["largest files:"]
    lines += [f"  {_mib(size):>11}  {name}" for name, size in Counter(sizes).most_common(n)]
    return "\n".join(lines)


@pytest.fixture(scope="module")
def sizes() -> dict[str, int]:
    found = tracked_sizes()
    assert found, "git ls-files listed no file"
    return found


def test_no_tracked_file_is_over_2_mib(sizes):
    big = [(size, name) for name, size in sizes.items() if size > MAX_FILE]
    assert not big, f"tracked files over {_mib(MAX_FILE)} (keep large data out of git, or thin it):\n" + "\n".join(
        f"  {_mib(size):>11}  {name}" for size, name in sorted(big, reverse=True)
    )


def test_tracked_files_outside_the_runs_total_at_most_8_mib(sizes):
    other = {name: size for name, size in sizes.items() if not name.startswith(RUNS)}
    total = sum(other.values())
    assert total <= MAX_OTHER, (
        f"the {len(other)} tracked files outside {RUNS} take {_mib(total)}, over {_mib(MAX_OTHER)}\n{biggest(other)}"
    )


def test_committed_runs_total_at_most_16_mib_and_each_is_thinned(sizes):
    runs = Counter()
    for name, size in sizes.items():
        if name.startswith(RUNS):
            runs["/".join(name.split("/")[:4])] += size
    fat = sorted(((size, run) for run, size in runs.items() if size > MAX_RUN), reverse=True)
    assert not fat, f"run folders over {MAX_RUN // 1024} KiB: thin them with `python scripts/downsample_runs.py`\n" + (
        "\n".join(f"  {size // 1024:>6} KiB  {run}" for size, run in fat)
    )
    total = sum(runs.values())
    assert total <= MAX_RUNS, f"the {len(runs)} committed runs take {_mib(total)}, over {_mib(MAX_RUNS)}"
