pub(crate) mod saga_node;
