"""The app's routes, one APIRouter per concern; `server.app.create_app` includes them in order."""
