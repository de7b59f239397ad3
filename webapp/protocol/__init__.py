"""The API's wire formats, one module per API: pydantic models of what a request sends and what
the API answers. `jobs`: /v1/jobs, the teaching endpoints, health; `openai`: completions, chat,
models, tokenize; `batches`: files and batches; `errors`: the one error shape. The job contract
the workers share is tasks/schemas.py."""
