"""The inference engines a served teacher asks (`ServedTeacher(engine=...)`): the protocol every
engine keeps and the reply types it answers with (`protocol.py`: `ServedEngine`, `ServedModel`,
`SampleRows`), the engines' names in one table (`names.py`, standard library only: the entry
grammar reads it without importing the client), and one module per engine (`vllm.py`). An engine
is small: the request for a sample and its reply read into the reply types; the one HTTP client
(`teachers/served/http.py`) owns the deadline, retries and connections."""
