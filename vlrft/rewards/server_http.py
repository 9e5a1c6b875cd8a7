"""waitress answers some requests itself, before the Flask app sees them (a Content-Length over
`max_request_body_size`, a malformed request line, headers too large). Its answers are plain
text; these classes make them JSON {"error": one line} like the app's, so a client reads every
refusal the same way. Imported only by vlrft.rewards.server.serve (waitress is an extra)."""

from __future__ import annotations

import json
import sys

from waitress.channel import HTTPChannel
from waitress.task import ErrorTask
from waitress.utilities import RequestEntityTooLarge


class JsonErrorTask(ErrorTask):
    def execute(self):
        err = self.request.error
        if isinstance(err, RequestEntityTooLarge):
            cap = self.channel.server.adj.max_request_body_size - 1
            message = f"request body is over twice the limit of {cap // 2} bytes (--max-body-mb)"
        else:
            message = f"{err.reason}: {err.body}"
        body = json.dumps({"error": message}).encode()
        print(f"vlrft reward server: {err.code} (refused by waitress) from {self.channel.addr[0]}: {message}",
              file=sys.stderr, flush=True)
        self.status = f"{err.code} {err.reason}"
        self.response_headers.append(("Content-Type", "application/json"))
        self.set_close_on_finish()
        self.content_length = len(body)
        self.write(body)


class JsonErrorChannel(HTTPChannel):
    error_task_class = JsonErrorTask
