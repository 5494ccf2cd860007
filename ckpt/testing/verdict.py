"""The one verdict model of the kill-and-resume checks, and its one exit-code table.

Both harnesses (``resume_entry``: an entry point under ``RunContext``; ``resume_command``:
an unmodified command and its step ledgers) end in one of these verdicts, and
``ckpt check-resume`` exits with ``EXIT_CODES[verdict]`` in either mode (spec/cli.md §2,
§4.5). A check that could not run at all (an attempt crashed under ``--entry``) raises
``ResumeCheckError`` instead, exit 1.
"""

from __future__ import annotations

import enum

__all__ = ["Verdict", "EXIT_CODES"]


class Verdict(enum.StrEnum):
    """The verdict of a kill-and-resume check; ``EXIT_CODES`` maps each to the command's exit code."""

    #: every compared step, tensor, RNG stream and data position is bit-identical
    IDENTICAL = "IDENTICAL"
    #: the resumed run differs; the first difference is named
    DIFFERENT = "DIFFERENT"
    #: the runs were compared, but a bit-exact claim cannot hold between them (their
    #: environments or world sizes differ, or no attempt actually resumed)
    REFUSED = "REFUSED"
    #: nothing could be compared (no ledger, no checkpoint reached before a kill, the
    #: command failed): such a check does not pass
    NO_CLAIM = "NO CLAIM"

    @property
    def exit_code(self) -> int:
        return EXIT_CODES[self]

    @property
    def passed(self) -> bool:
        return self is Verdict.IDENTICAL


#: REFUSED shares DIFFERENT's code: in both, the runs ran and no exactness can be claimed
EXIT_CODES: dict[Verdict, int] = {
    Verdict.IDENTICAL: 0,
    Verdict.DIFFERENT: 6,
    Verdict.REFUSED: 6,
    Verdict.NO_CLAIM: 2,
}
"""The exit code of ``ckpt check-resume`` for each verdict: 0 identical, 6 different or refused, 2 no claim."""
