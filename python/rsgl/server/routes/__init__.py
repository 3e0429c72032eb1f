"""The HTTP routes, by audience: `openai` (the OpenAI API), `native` (SGLang's own
endpoints) and `admin` (health and metrics). Each is a module-level `APIRouter` whose
handlers reach the running server through `common.server_state`."""
