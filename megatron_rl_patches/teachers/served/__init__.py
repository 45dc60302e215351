"""The served wing: a teacher asked over HTTP from an inference engine (`ServedTeacher`), in one
folder. `client.py` (the teacher: argument checks, a step's samples sent and collected) holds one
endpoint; `http.py` (one URL's connection pool, deadline, retries) and `settings.py` (how the
client behaves); `engines/` (one module per engine: a request body and a parsed reply);
`pool.py` and `scheduler.py` (a teacher's replicas); `build.py` and `connect.py` (a served entry
built and connected for a training job). The public names load through `megatron_rl_patches.teachers`."""
