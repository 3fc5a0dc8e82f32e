"""How long a --ft round is and how often the guard checks: the pacing rules and their settings.

Steps per round (one vote each round) and steps between the guard's checks are sized by the
keeper from the run's pace and published in every quorum (ftrun.wire.Quorum's round_steps and
check_steps); the environment's overrides (FTRUN_FT_ROUND_STEPS, FTRUN_FT_CHECK_S,
FTRUN_FT_CHECK_STEPS) are parsed here alone, alike by the keeper, every member and ftrun's input
checks. Pure functions of the mapping they are given: must never read os.environ itself, import
torch, nor anything of ftrun's.
"""

from __future__ import annotations

from typing import Mapping, Optional, Tuple

# Steps per round, read by the keeper and published in every quorum: one vote, and one store
# round trip per member, for this many steps. Eight keep a 7 ms step's vote under 1% of it and a
# join or a switch within a few rounds; a failure costs no more steps than with one (keys.kept_key).
ROUND_STEPS = 8
ROUND_STEPS_ENV = "FTRUN_FT_ROUND_STEPS"
# Unless FTRUN_FT_ROUND_STEPS is set, a quorum published once the keeper has seen the run's pace has
# rounds of about this long (ROUND_STEPS steps at most): a restarted replica joins at a round's top,
# and 21M-parameter steps of 0.3 s in rounds of eight kept it waiting up to 2.4 s (measured: back in
# 2.5-3.0 s after half the kills). One vote per 0.2 s stays far under 1% of the time.
ROUND_TARGET_S = 0.2


def round_steps_for(step_s: Optional[float], most: int) -> int:
    """Steps per round for a run whose steps take `step_s` (None: not known yet): `most`, or
    fewer so that a round lasts about ROUND_TARGET_S (to the nearest step); one at least."""
    if step_s is None or not step_s > 0:
        return most
    return max(1, min(most, int(ROUND_TARGET_S / step_s + 0.5)))


def round_steps_from_env(env: Mapping[str, str]) -> Tuple[int, Optional[str]]:
    """(steps per round, a line saying why the environment's value was not taken, or None)."""
    raw = env.get(ROUND_STEPS_ENV)
    if raw is None:
        return ROUND_STEPS, None
    if raw.strip().isdigit() and 1 <= int(raw) <= 1024:
        return int(raw), None
    return ROUND_STEPS, (f"{ROUND_STEPS_ENV}={raw!r} is not a whole number of steps from 1 to 1024; fix it or "
                         f"unset {ROUND_STEPS_ENV} (default {ROUND_STEPS})")


# The guard (worker/ft/heal/agreement.py): the quorum's members compare a fingerprint of their whole
# state at a round's top after a heal's first round, and every CHECK_S seconds of training at the
# run's pace (Quorum.check_steps, sized by the keeper). FTRUN_FT_CHECK_S=0 turns it off.
CHECK_S = 300.0
CHECK_S_ENV = "FTRUN_FT_CHECK_S"
# Steps between checks while the run's pace is not known (a sharded replica's quorums are not re-paced).
CHECK_STEPS_UNPACED = 1000


def check_s_from_env(env: Mapping[str, str]) -> Tuple[float, Optional[str]]:
    """(seconds between the guard's checks, 0 for none; a line saying why the environment's value
    was not taken, or None). Read alike by the keeper and every member."""
    raw = env.get(CHECK_S_ENV)
    if raw is None:
        return CHECK_S, None
    try:
        value = float(raw)
    except ValueError:
        value = -1.0
    if value >= 0 and value == value and value != float("inf"):
        return value, None
    return CHECK_S, (f"{CHECK_S_ENV}={raw!r} is not a number of seconds (0 or more); fix it or unset {CHECK_S_ENV} "
                     f"(default {CHECK_S:g})")


CHECK_STEPS_ENV = "FTRUN_FT_CHECK_STEPS"


def check_steps_from_env(env: Mapping[str, str]) -> Tuple[Optional[int], Optional[str]]:
    """(steps between the guard's checks the user chose, or None; a line saying why the
    environment's value was not taken, or None)."""
    raw = env.get(CHECK_STEPS_ENV)
    if raw is None:
        return None, None
    if raw.strip().isdigit() and int(raw) >= 1:
        return int(raw), None
    return None, (f"{CHECK_STEPS_ENV}={raw!r} is not a whole number of steps (1 or more); fix it or unset "
                  f"{CHECK_STEPS_ENV} (unset: about every {CHECK_S_ENV} seconds)")


def check_steps_for(step_s: Optional[float], check_s: float) -> int:
    """Steps between the guard's checks for a run whose steps take `step_s` (None: not known yet):
    about `check_s` seconds of them, one at least; 0 (none) when the guard is off."""
    if check_s <= 0:
        return 0
    if step_s is None or not step_s > 0:
        return CHECK_STEPS_UNPACED
    return max(1, int(check_s / step_s + 0.5))
