"""The per-round profile (decision 0092)."""

from __future__ import annotations

import shutil

from bench import profile
from bench.context import (
    BenchContext,
    Rotating,
)


class Profiling(BenchContext):
    """The per-round profile (decision 0092)."""

    async def profile(self, stream: Rotating) -> None:
        env = self.env
        assert env.planner is not None
        if profile.find_py_spy() is None:
            self.report.notes.append(
                "Profile skipped: py-spy is not installed (pip install py-spy)."
            )
            return
        output = env.work / "profile.txt"
        recorder = profile.start_recording(env.planner.pid, self.sizes.profile_s, output)
        turns = 0
        while recorder.poll() is None:
            await self.turns(stream, 1)
            turns += 1
        stderr = recorder.stderr.read().decode(errors="replace") if recorder.stderr else ""
        if recorder.returncode != 0 or not output.exists():
            self.report.notes.append(
                f"Profile failed (py-spy exit {recorder.returncode}): {stderr[-300:]}"
            )
            return
        found = profile.analyse(output.read_text())
        self.report.profile = {
            "turns": turns,
            "samples": found.samples,
            "components": found.components,
            "planner_functions": found.planner_functions,
            "inclusive": found.inclusive,
        }
        if self.options.out:
            self.options.out.mkdir(parents=True, exist_ok=True)
            shutil.copy(output, self.options.out / "profile-collapsed.txt")
