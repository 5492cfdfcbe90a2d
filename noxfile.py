"""The single entry point for checks: `nox -s tests`, `lint`, `mypy`, `docs`, `bench`, `compat`,
`interop`."""

from __future__ import annotations

import sys

import nox

nox.options.sessions = ["lint", "tests"]
nox.options.reuse_existing_virtualenvs = True

# torch is pinned to the CPU build for development and CI; the package only asks for a range.
INSTALL = ("-c", "constraints.txt", "-e", ".[test]")


def _install_here(session: nox.Session) -> None:
    """Install the package and its test tools into the interpreter that runs nox.

    The README's commands make one ``.venv`` and run nox from it; a second environment of nox's
    own would install torch again (2.4 GB, ~3 minutes before the first test).
    """
    session.run(sys.executable, "-m", "pip", "install", "-q", *INSTALL, external=True)


@nox.session(venv_backend="none")
def tests(session: nox.Session) -> None:
    """Run the test suite in nox's own environment (CPU only; the GPU script is tests/gpu/)."""
    _install_here(session)
    session.run(sys.executable, "-m", "pytest", *session.posargs, external=True)


@nox.session
def lint(session: nox.Session) -> None:
    """ruff: lint and formatting."""
    # Pinned: formatting (of markdown code blocks too) changes between releases.
    session.install("ruff==0.17.6")
    session.run("ruff", "check", ".")
    session.run("ruff", "format", "--check", ".")


# The documentation site's tools, pinned together: --strict fails on any warning, and a new release
# of any of them can add one. ruff formats the API reference's signatures.
DOCS = (
    "mkdocs==1.6.1",
    "mkdocs-material==9.8.2",
    "mkdocstrings[python]==1.0.8",
    "mkdocstrings-python==2.0.11",
    "griffelib==2.4.1",
    "mkdocs-autorefs==1.4.5",
    "pymdown-extensions==13.1.2",
    "markdown==3.11.3",
    "ruff==0.17.6",
)


@nox.session
def docs(session: nox.Session) -> None:
    """Build the documentation site into site/ (`-- --site-dir DIR` elsewhere); warnings fail it.

    The API reference is read from the source by griffe, so neither hsdump nor torch is installed.
    """
    session.install(*DOCS)
    site = session.posargs or ["--site-dir", "site"]
    session.run("mkdocs", "build", "--strict", *site, env={"NO_MKDOCS_2_WARNING": "1"})


@nox.session(venv_backend="none")
def mypy(session: nox.Session) -> None:
    """Type-check the package."""
    _install_here(session)
    session.run(sys.executable, "-m", "pip", "install", "-q", "mypy>=1.10", external=True)
    session.run(sys.executable, "-m", "mypy", external=True)


@nox.session(venv_backend="none")
def bench(session: nox.Session) -> None:
    """Benchmarks: each prints its figures, the target, and the command that reproduces it.

    `nox -s bench -- --quick` for short runs; `-- --strict` fails the session on a missed target.
    """
    _install_here(session)
    flags = [arg for arg in session.posargs if arg in ("--quick", "--strict")]
    for script in ("bench_store.py", "bench_pipeline.py", "bench_scale.py"):
        session.run(sys.executable, f"benchmarks/{script}", *flags, external=True)


# The trainers whose readers and batches tests/interop checks hsdump against.
SPECULATORS = "speculators==0.9.0"
SPECFORGE = "specforge==0.2.0"


@nox.session
def interop(session: nox.Session) -> None:
    """The exports and the trainers' batches against the real SpecForge and speculators (CPU).

    Not in the default sessions: it installs both trainers (about 2 minutes, 1.5 GB with torch)
    into nox's own environment. speculators pulls CUDA builds of torchvision and torchaudio that
    break transformers on CPU torch and that it never imports: they are removed. SpecForge pins
    torch 2.11 and SGLang, which its offline readers do not import: it goes in without them.
    """
    # Not the [test] extra: its s3fs pins an fsspec that speculators' datasets (<= 5.1) refuses.
    session.install(
        "-c", "constraints.txt", "-e", ".[export]", "pytest>=8", "pytest-timeout>=2.3", SPECULATORS
    )  # fmt: skip
    session.run("python", "-m", "pip", "uninstall", "-q", "-y", "torchvision", "torchaudio")
    session.install("--no-deps", SPECFORGE)
    session.run("pytest", "-p", "no:cacheprovider", "tests/interop", *session.posargs)


@nox.session
def compat(session: nox.Session) -> None:
    """The store's zarr compatibility tests against one zarr release: `nox -s compat -- 3.1.1`."""
    if len(session.posargs) != 1:
        session.error("name one zarr release: nox -s compat -- 3.1.1")
    session.install("-c", "constraints.txt", "-e", ".", f"zarr=={session.posargs[0]}")
    session.install("pytest>=8", "pytest-timeout>=2.3", "hypothesis>=6.100")
    session.run("python", "-c", "import zarr; print('zarr', zarr.__version__)")
    store_tests = ("test_zarr_compat.py", "test_store.py", "test_store_zarr.py")
    session.run("pytest", "-p", "no:cacheprovider", *(f"tests/{name}" for name in store_tests))
