"""Debian packages for the tests that drive the web pages (Chromium) or run Prometheus:
installed with apt in the test's own setup when missing, one xdist worker at a time, or a
skip that says why this machine cannot install them."""
import pytest
from filelock import FileLock

from benchmarks.browser import Unavailable, chromium as _chromium, debian_packages


def ensure_debian_packages(packages: list[str], binaries: list[str], tmp_root) -> dict[str, str]:
    with FileLock(str(tmp_root / "apt.lock")):
        try:
            return debian_packages(packages, binaries)
        except Unavailable as e:
            pytest.skip(str(e))


def chromium(tmp_root):
    """A Selenium driver for headless Chromium."""
    return _chromium(ensure_debian_packages(["chromium", "chromium-driver"],
                                            ["chromium", "chromedriver"], tmp_root))
