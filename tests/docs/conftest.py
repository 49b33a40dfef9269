from ..serving.conftest import start_stack as start_stack
