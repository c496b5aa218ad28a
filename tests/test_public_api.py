"""The public API is exactly what __all__ lists, sorted, and every name resolves."""

import mixer


def test_all_is_sorted_and_complete():
    assert mixer.__all__ == sorted(mixer.__all__)
    for name in mixer.__all__:
        assert getattr(mixer, name) is not None
    public = {n for n in dir(mixer) if not n.startswith("_") and not isinstance(getattr(mixer, n), type(mixer))}
    assert public == set(mixer.__all__)
