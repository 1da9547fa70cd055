"""Imported by the conformance fork server before it forks any worker: loads the node test
cases, the runner's classes and the packager once (see ``driver.Pool``)."""

from tools.conformance.driver import warm

warm()
