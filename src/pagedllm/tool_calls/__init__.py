"""Tool calling, shared by the server and the offline ``LLM`` (pure Python, no torch).

- ``tools``: a request's tools and tool choice checked (``InvalidToolRequest`` names the
  field).
- ``render``: the conversation through the model's chat template with its ``tools``, or
  the generic format for a template without them; the format chosen (``ToolPlan``).
- ``parsers``: each family's calls read from the reply as it streams (over ``json_scan``).
- ``constraints``: the grammar a reply that must be calls is held to.
"""
