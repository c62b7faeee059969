"""The errors a user sees. Each is shown as one `error: ...` line on stderr, exit status 2,
never a traceback (cli.main): the message must say what was wrong, where (file and line), and
what to do. No imports: every module may raise them."""


class AttnError(Exception):
    """A problem with the user's input or environment."""


class TrainingDiverged(AttnError):
    """The training loss became inf or NaN: the run stops, its last good checkpoint kept."""
