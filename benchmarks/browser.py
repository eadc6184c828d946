"""A real headless Chromium (Debian's chromium and chromium-driver, driven by Selenium) and
other Debian packages the web benchmarks and tests run, installed with apt-get when missing."""
from __future__ import annotations

import os
import shutil
import subprocess


class Unavailable(RuntimeError):
    """The packages are missing and this machine cannot install them (the reason says why)."""


def debian_packages(packages: list[str], binaries: list[str]) -> dict[str, str]:
    """The paths of `binaries`, installing `packages` with apt-get first if one is missing.
    Callers that may run at once hold a lock around this (apt allows one install at a time)."""
    found = {b: shutil.which(b) for b in binaries}
    if all(found.values()):
        return found
    if shutil.which("apt-get") is None:
        raise Unavailable(f"{', '.join(binaries)} missing and this machine has no apt-get to "
                          f"install {' '.join(packages)}")
    sudo = [] if os.geteuid() == 0 else ["sudo", "-n"]
    if sudo and shutil.which("sudo") is None:
        raise Unavailable(f"{', '.join(binaries)} missing and installing {' '.join(packages)} "
                          "needs root")
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    install = [*sudo, "apt-get", "install", "-y", "-q", "--no-install-recommends", *packages]
    done = subprocess.run(install, env=env, capture_output=True, text=True)
    if done.returncode != 0:  # the package lists may be missing or stale
        subprocess.run([*sudo, "apt-get", "update", "-q"], env=env, capture_output=True)
        done = subprocess.run(install, env=env, capture_output=True, text=True)
    if done.returncode != 0:
        raise Unavailable(f"could not install {' '.join(packages)} with apt-get: "
                          f"{(done.stderr or done.stdout)[-500:]}")
    found = {b: shutil.which(b) for b in binaries}
    missing = [b for b, p in found.items() if not p]
    if missing:
        raise Unavailable(f"{' '.join(packages)} installed but {', '.join(missing)} not found")
    return found


def chromium(paths: dict[str, str] | None = None, width: int = 1200, height: int = 820):
    """A Selenium driver for headless Chromium; `paths` from debian_packages (installed here
    when not given)."""
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    if paths is None:
        paths = debian_packages(["chromium", "chromium-driver"], ["chromium", "chromedriver"])
    opts = webdriver.ChromeOptions()
    opts.binary_location = paths["chromium"]
    for arg in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage", "--disable-gpu",
                f"--window-size={width},{height}", "--force-color-profile=srgb"):
        opts.add_argument(arg)
    return webdriver.Chrome(service=Service(executable_path=paths["chromedriver"]), options=opts)
