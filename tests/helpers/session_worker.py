"""Answer one turn from a sessions home in a process of its own (the restart half of test_sessions).

stdin: {"home", "messages", "session_id", "max_tokens"}; stdout, last line: {"tokens", "cached_tokens",
"snapshot_id", "saved_snapshot_id", "miss_reasons"}. Greedy, no drafting, the embedded SmolLM2 on the
test backend (`tests.helpers.backends`), as the test process has it.
"""

from __future__ import annotations

import json
import sys

from agentfold import prepare_process

prepare_process()

from agentfold.engine.decode import GenerationConfig  # noqa: E402
from agentfold.engine.factory import build_engine  # noqa: E402
from agentfold.serve.models import default_model_path  # noqa: E402
from agentfold.sessions import SessionManager  # noqa: E402
from tests.helpers.backends import real_model_backend  # noqa: E402


def main() -> None:
    job = json.load(sys.stdin)
    engine = build_engine(default_model_path(), drafter="none", self_check=False, backend=real_model_backend())
    manager = SessionManager(engine, job["home"])
    config = GenerationConfig(max_tokens=job["max_tokens"], draft=False)
    completion, info = manager.reply(job["messages"], config, session_id=job["session_id"])
    print(json.dumps({"tokens": completion.tokens, "cached_tokens": info.cached_tokens,
                      "snapshot_id": info.snapshot_id, "saved_snapshot_id": info.saved_snapshot_id,
                      "miss_reasons": info.miss_reasons}))


if __name__ == "__main__":
    main()
