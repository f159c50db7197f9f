"""Tool calling, shared by the server and the offline ``LLM``: each family's tool-call
format read as the text streams (``parsers``, over ``json_scan``)."""
