"""Scripts that run in their own interpreter, standard library only: the sandbox's
bootstrap (``boot``), the candidate server inside the sandbox, the grader outside it,
and the plain-value ``wire`` format between them. Started as scripts
(``python -I -S .../boot.py``); this directory is bound read-only into every sandbox
at ``/.asyncrl``. Importable as a package for tests only."""
