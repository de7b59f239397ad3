"""The API's wire formats, one module per API: pydantic models of what a request sends and what
the API answers. `jobs`: `Jobs` (what every request turns itself into), /v1/jobs, the teaching
endpoints, health; OpenAI's (and vLLM's) `completions`, `chat`, `models` and `tokenize`, with
what completions and chat share in `sampling` and `common`; `batches`: files and batches;
`errors`: the one error shape. The job contract the workers share is tasks/schemas.py."""
