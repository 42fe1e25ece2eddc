module grpo.dev/hack/node/images

go 1.26.0
