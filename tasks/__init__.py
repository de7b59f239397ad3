"""The contract shared by the API and the workers.

Light imports only: the API process imports this package and must never pull in torch,
transformers or vllm.
"""
