"""kforge._dispatch_test: a stand-in launcher for kforge._dispatch's tests, built only with
KFORGE_TESTING (never part of kforge._dispatch)."""

def test_launcher_address() -> int:
    """A stand-in for kforge_registry_launch on CPU pointers, for tests: variant id 0 copies
    `context` bytes of input 0 into output 0, 1 writes relu of `context / 4` floats, 2 fails."""

def test_launcher_log() -> dict:
    """The test launcher's last call: calls, vid, n_in, n_out, n_ws, stream, in0, out0, ctx."""
