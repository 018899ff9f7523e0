"""Framework adapters over tl_dist's framework-free core, installed as ``tl_dist.integrations``.

- :mod:`tl_dist.integrations.lightning`: ``TelemetryCallback`` (needs ``pip install 'tl_dist[lightning]'``).

This folder sits beside ``tl_dist/`` in the repository and is mapped into the package by ``package-dir``
(pyproject.toml); one file must be one module, so importing it under its folder name fails.
"""

if __name__ != "tl_dist.integrations":
    raise ImportError(
        f"{__name__!r} is tl_dist's adapter folder; import it as tl_dist.integrations "
        "(e.g. `from tl_dist.integrations.lightning import TelemetryCallback`) after `pip install -e .`"
    )
