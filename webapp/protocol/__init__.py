"""The API's wire formats, one module per API: pydantic models of what a request sends and what
the API answers. `openai`: completions, chat, models, tokenize; `batches`: files and batches;
`errors`: the one error shape."""
