"""The wire APIs the server speaks, one module per API (routes and answer shapes) beside its request bodies:
OpenAI's (openai.py, openai_protocol.py) and TGI's (tgi.py, tgi_protocol.py); common.py holds what both use."""
