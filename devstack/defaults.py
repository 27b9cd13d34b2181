"""Where the devstack and the planner of ``dev`` listen unless told otherwise: the
constants of the command line, the standalone devstack and the composition root, kept in
a module that imports nothing so that ``ballet-planner --help`` stays quick."""

#: The devstack's gRPC address (tracker, skills, knowledge and the LLM gateway).
DEFAULT_ADDRESS = "127.0.0.1:50052"
#: The planner's address in ``dev`` (its ``server.address`` default).
PLANNER_ADDRESS = "127.0.0.1:50051"
#: How to get buf, for the banner's ``buf curl`` lines: the README's recipe, word for word
#: (a test checks), which writes nothing into the checkout outside ``.venv``.
BUF_INSTALL = "npm install --no-save --prefix .venv/buf @bufbuild/buf"
#: Where that puts the program.
BUF_PROGRAM = ".venv/buf/node_modules/.bin/buf"
