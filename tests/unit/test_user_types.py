"""A user's script type-checks (mypy --strict) with every form of a setting that works at run
time: ``gradient_accumulation_steps`` as a number, text, a step -> k mapping (int or text
keys), a ramp-up mapping and a callable."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
FORMS = [
    "4",
    '"0:2 100:4"',
    "{0: 2, 100: 4}",
    '{"0": 2, "100": 4}',
    '{"start": 4, "increment": 4, "samples": 64}',
    "lambda step: 2 if step < 100 else 4",
]


@pytest.mark.parametrize("form", FORMS)
def test_each_form_works_at_run_time(form: str, clean_env: pytest.MonkeyPatch) -> None:
    from gradsync import Accelerator

    ramp = {"global_batch_size": 8} if "start" in form else {}  # a ramp-up ramps up to it
    accel = Accelerator(gradient_accumulation_steps=eval(form), micro_batch_size=2, **ramp)
    assert accel.gradient_accumulation_steps >= 1


def test_each_form_type_checks_in_a_users_script(tmp_path: Path) -> None:
    if shutil.which("mypy", path=str(Path(sys.executable).parent)) is None:
        pytest.skip("mypy is not installed (pip install -e '.[test]')")
    script = tmp_path / "user.py"
    script.write_text(
        "from gradsync import Accelerator\n\n"
        + "".join(
            f"Accelerator(gradient_accumulation_steps={form}, micro_batch_size=2, global_batch_size=8)\n"
            for form in FORMS
        )
        + "accel = Accelerator()\naccel.gradient_accumulation_steps = 8\n"
    )
    # From the checkout, with its mypy cache (scripts/test.sh type-checks gradsync first).
    done = subprocess.run(
        [str(Path(sys.executable).parent / "mypy"), "--strict", str(script)],
        capture_output=True,
        text=True,
        cwd=REPO,
        timeout=900,
    )
    assert done.returncode == 0, done.stdout + done.stderr
