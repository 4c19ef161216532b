"""`lucebox harness`: real agent clients and chat UIs, installed from their registries and run against a
`lucebox serve` on loopback as regression tests (runner.py says what is checked)."""
