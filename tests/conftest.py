"""Makes tests/ importable (pytest puts a conftest's folder on sys.path), so every test folder
can share `server_process`."""
