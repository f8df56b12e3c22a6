"""Test helpers: the float64 oracle, shared cases and tolerances, reference models and the
interpreter of lowered score_mod programs. Tests import them as ``from support import ...``
(pytest puts tests/ on the path: pyproject's ``pythonpath``)."""
