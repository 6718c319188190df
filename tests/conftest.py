import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))

# Fixtures shared by many test files: the lab API server (in-process and as a subprocess), and the
# kernel tests' pin directories and netns topologies.
pytest_plugins = ["lab_server", "test_bpf_support"]
